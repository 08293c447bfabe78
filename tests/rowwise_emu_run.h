// The CPU launcher of tests/rowwise_emu.h: included after a generated row kernel's source.
#pragma once
#ifndef KSPEC_EMU_SMS
#define KSPEC_EMU_SMS 132     // the SM count the host glue is told (an H100 / H200)
#endif

extern "C" int kspec_emu_run(const int64_t* dims, void* const* ptrs, const double* scalars, int64_t* launch,
                             char* err, uint64_t err_cap) {
  alignas(16) unsigned char blob[sizeof(Params)];
  uint64_t psize = 0;
  uint32_t grid[3], block[3], cluster[3], smem = 0;
  int rc = kspec_prepare(dims, ptrs, scalars, nullptr, 0, KSPEC_EMU_SMS, blob, sizeof(blob), &psize, grid, block, cluster,
                         &smem, err, err_cap);
  if (rc) return rc;
  Params p;
  std::memcpy(&p, blob, sizeof(Params));
  // what the launch was: grid, block x, block y, cluster, dynamic smem, vector path, cached
  launch[0] = grid[0]; launch[1] = block[0]; launch[2] = block[1]; launch[3] = cluster[0];
  launch[4] = smem; launch[5] = p.vec; launch[6] = p.cache;
  const unsigned cs = cluster[0], nthreads = block[0] * block[1];
  if (block[0] % 32 || grid[0] % cs) { std::snprintf(err, err_cap, "bad launch geometry"); return 1; }
  for (unsigned c0 = 0; c0 < grid[0]; c0 += cs) {
    kspec_emu::Cluster cl;
    cl.bar = std::make_unique<std::barrier<>>(cs * nthreads);
    std::vector<std::unique_ptr<kspec_emu::Cta>> ctas;
    for (unsigned r = 0; r < cs; ++r) {
      auto cta = std::make_unique<kspec_emu::Cta>();
      cta->dynamic.assign(smem + 16, 0xAB);            // garbage, as on a GPU
      cta->bar = std::make_unique<std::barrier<>>(nthreads);
      for (unsigned w = 0; w < nthreads / 32; ++w) cta->warp_bar.push_back(std::make_unique<std::barrier<>>(32));
      cta->warp_slot.assign(nthreads, 0.0f);
      cta->cluster = &cl;
      cta->rank = r;
      cl.ctas.push_back(cta.get());
      ctas.push_back(std::move(cta));
    }
    std::vector<std::thread> threads;
    for (unsigned r = 0; r < cs; ++r)
      for (unsigned y = 0; y < block[1]; ++y)
        for (unsigned x = 0; x < block[0]; ++x)
          threads.emplace_back([&, r, x, y] {
            auto& t = kspec_emu::tls;
            t.tid = {x, y, 0}; t.bid = {c0 + r, 0, 0}; t.bdim = {block[0], block[1], 1}; t.gdim = {grid[0], 1, 1};
            t.cta = cl.ctas[r]; t.bump = 0;
            const unsigned linear = y * block[0] + x;
            t.warp = linear / 32; t.lane = linear % 32;
            kspec_kernel(p);
          });
    for (auto& th : threads) th.join();
  }
  return 0;
}
