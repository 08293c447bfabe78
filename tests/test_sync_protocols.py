"""kspec's own GPU synchronisation, proved without a GPU (issue 22).

The CuTe DSL GEMM kernels (backends/cute/sm90.py, sm100.py) take every ring slot, mbarrier
parity, arrive count, transaction byte count and multicast mask from `backends/cute/sync.py`.
This file simulates the producers and consumers of every barrier the kernels create with those
same functions, on a model of mbarrier semantics:

- a barrier has an arrive count; a phase completes when its pending arrivals and its
  transaction count both reach zero (then the arrivals reset for the next phase);
- `wait(parity)` passes iff the phase of that parity has completed, i.e. the barrier's current
  phase bit differs from `parity`;
- TMA loads, TMA stores and tcgen05 commits complete asynchronously, in any order the random
  scheduler picks.

Every agent (producer warp, consumer/MMA warps, epilogue warps, per CTA of a cluster) is a
generator of operations.  The checks, on every interleaving the seeds produce:
- every wait passes on exactly the phase its use needs (not one early: the data it guards has
  landed, with the identity the consumer expects; not one late: not lapped);
- no buffer (A/B stage, residual sub-tile, D/aux staging buffer, TMEM accumulator) is written
  before every reader of its previous contents released it;
- no barrier receives more arrivals than its count in one phase, or more bytes than expected;
- at the end every barrier is balanced (no pending arrivals or bytes), nothing deadlocks.
"""
from __future__ import annotations

import random
from collections import defaultdict

import pytest
from conftest import test_cache_root
from test_cute_backend import needs_dsl

from kspec.backends.cute import sync
from kspec.core import KspecInternalError


class ProtocolError(AssertionError):
    pass


class Barrier:
    """An mbarrier: `count` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self, name: str, count: int):
        self.name, self.count = name, count
        self.pending, self.tx, self.completed = count, 0, 0

    def arrive(self, tx: int = 0):
        if self.pending == 0:
            raise ProtocolError(f"{self.name}: an arrival beyond its count {self.count} in phase {self.completed}")
        self.tx += tx
        self.pending -= 1
        self._settle()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        if self.tx < 0 and self.pending == 0:
            raise ProtocolError(f"{self.name}: {-self.tx} bytes more than expected in phase {self.completed}")
        self._settle()

    def _settle(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:
        return self.completed % 2 != parity

    def balanced(self) -> bool:
        return self.pending == self.count and self.tx == 0


class Sim:
    """Agents (generators yielding ops) and asynchronous events, run in a random interleaving."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.agents: dict[str, object] = {}
        self.blocked: dict[str, tuple] = {}
        self.events: list[tuple[str, object]] = []
        self.barriers: list[Barrier] = []
        self.named = defaultdict(lambda: [0, 0])       # key -> [arrived, generation]
        self.log: list[str] = []

    def barrier(self, name, count):
        b = Barrier(name, count)
        self.barriers.append(b)
        return b

    def agent(self, name, gen):
        self.agents[name] = gen
        self.blocked[name] = None

    def later(self, what, fn):
        """An asynchronous completion (TMA, commit) the scheduler runs at a random later step."""
        self.events.append((what, fn))

    def _ready(self, op) -> bool:
        if op is None:
            return True
        kind = op[0]
        if kind == "wait":
            return op[1].passes(op[2])
        if kind == "until":
            return op[1]()
        if kind == "sync":
            return self.named[op[1]][1] > op[3]
        raise AssertionError(op)

    def _resume(self, name):
        gen = self.agents[name]
        op = self.blocked[name]
        if op is not None and op[0] == "wait" and op[1].completed != op[3]:
            b = op[1]
            raise ProtocolError(f"{name}: wait({op[2]}) on {b.name} passed with {b.completed} phase(s) complete; "
                                f"its use needs exactly {op[3]} ({op[4]})")
        try:
            nxt = next(gen)
        except StopIteration:
            del self.agents[name]
            del self.blocked[name]
            return
        if nxt[0] == "sync":                       # named barrier: arrive now, wait for the generation
            key, count = nxt[1], nxt[2]
            st = self.named[key]
            gen_no = st[1]
            st[0] += 1
            if st[0] == count:
                st[0], st[1] = 0, st[1] + 1
            nxt = ("sync", key, count, gen_no)
        self.blocked[name] = nxt

    def run(self, max_steps=2_000_000):
        for name in list(self.agents):
            self._resume(name)
        for _ in range(max_steps):
            ready = [("agent", n) for n, op in self.blocked.items() if self._ready(op)]
            ready += [("event", i) for i in range(len(self.events))]
            if not ready:
                if self.agents:
                    stuck = {n: (op[0], getattr(op[1], "name", op[1]), op[2] if len(op) > 2 else None)
                             for n, op in self.blocked.items()}
                    raise ProtocolError(f"deadlock: {stuck}")
                break
            kind, x = self.rng.choice(ready)
            if kind == "agent":
                self._resume(x)
            else:
                _, fn = self.events.pop(x)
                fn()
        else:
            raise ProtocolError("no progress bound reached")
        bad = [f"{b.name} (pending {b.pending}/{b.count}, tx {b.tx})" for b in self.barriers if not b.balanced()]
        if bad:
            raise ProtocolError("barriers unbalanced at kernel end: " + ", ".join(bad))


def wait(bar, parity, need, what=""):
    return ("wait", bar, parity, need, what)


class Ring:
    """Contents of one buffer ring per CTA: which use each slot holds, which of its parts landed,
    and which readers still hold it; writes into a slot whose previous use is not released fail."""

    def __init__(self, name, stages, readers):
        self.name, self.stages, self.readers = name, stages, readers
        self.use = {}                     # slot -> use id
        self.parts = defaultdict(set)     # slot -> parts landed
        self.released = defaultdict(int)  # slot -> releases of its current use
        self.reads = defaultdict(int)

    def check_free(self, slot, use):
        """A write of `use` may start (it is issued): the slot's previous use is released."""
        old = self.use.get(slot)
        if old is not None and old != use and self.released[slot] < self.readers:
            raise ProtocolError(f"{self.name}[{slot}]: use {use} written while use {old} is held by "
                                f"{self.readers - self.released[slot]} reader(s)")

    def write(self, slot, use, part):
        if self.use.get(slot) != use:
            self.check_free(slot, use)
            self.use[slot], self.parts[slot], self.released[slot] = use, set(), 0
        if part in self.parts[slot]:
            raise ProtocolError(f"{self.name}[{slot}]: part {part} of use {use} written twice")
        self.parts[slot].add(part)

    def read(self, slot, use, parts):
        if self.use.get(slot) != use or self.parts[slot] != set(parts):
            raise ProtocolError(f"{self.name}[{slot}]: read of use {use} found use {self.use.get(slot)} with parts "
                                f"{sorted(self.parts[slot])} of {sorted(parts)}: the wait passed before the data landed")

    def release(self, slot, use):
        if self.use.get(slot) != use:
            raise ProtocolError(f"{self.name}[{slot}]: release of use {use}, but it holds {self.use.get(slot)}")
        self.released[slot] += 1


class StoreRing:
    """The D/aux staging buffers drained by TMA stores (PipelineTmaStore: bulk groups)."""

    def __init__(self, name, stages):
        self.name, self.stages = name, stages
        self.inflight: list[int] = []     # slots whose TMA store has not finished reading

    def write(self, slot):
        if slot in self.inflight:
            raise ProtocolError(f"{self.name}[{slot}]: written while its TMA store still reads it")


# ------------------------------------------------------------------------------------------ the kernels
def a_b_bytes(cfg):
    return cfg.get("a_bytes", 16384), cfg.get("b_bytes", 8192)


def build_kernel(sim: Sim, arch: str, cfg: dict, residual_start=sync.residual_start):
    """Every agent and barrier of one cluster of kspec's GEMM kernel on `arch`.
    cfg: cluster (M, N), use_2cta, stages, tiles (per CTA), k_tiles, n_sub (epilogue sub-tiles per
    tile), residual (a full epilogue input), dual."""
    cm, cn = cfg["cluster"]
    two = cfg.get("use_2cta", False)
    shape = sync.cluster_vmn((cm, cn), two) if arch == "sm100a" else (1, cm, cn)
    coords = sync.cta_coords(shape)
    stages, tiles, k_tiles, n_sub = cfg["stages"], cfg["tiles"], cfg["k_tiles"], cfg["n_sub"]
    num_b = 2 if cfg.get("dual") else 1
    a_bytes, b_bytes = a_b_bytes(cfg)
    V, M, N = shape
    rank = {c: sync.cta_rank(c, shape) for c in coords}
    at = {r: c for c, r in rank.items()}
    if arch == "sm90a":
        wgs = cfg.get("wgs", 1)
        consumer_warps = wgs * sync.SM90_WARPGROUP_WARPS
        empty_count = sync.sm90_ab_empty_arrivals((cm, cn), wgs)
        tx = sync.ab_stage_tx_bytes(a_bytes, b_bytes, num_b)
        epi_warps = consumer_warps
        store_stages = sync.EPI_STORE_STAGES["sm90a"]
    else:
        empty_count = sync.sm100_ab_empty_arrivals((cm, cn), two)
        tx = sync.ab_stage_tx_bytes(a_bytes, b_bytes, num_b, two)
        epi_warps = sync.SM100_EPI_WARPS
        store_stages = sync.EPI_STORE_STAGES["sm100a"]
        acc_empty_count = sync.sm100_acc_empty_arrivals(two)
    full = {r: [sim.barrier(f"cta{r}.ab_full[{i}]", sync.AB_FULL_ARRIVALS) for i in range(stages)] for r in rank.values()}
    empty = {r: [sim.barrier(f"cta{r}.ab_empty[{i}]", empty_count) for i in range(stages)] for r in rank.values()}
    # the CTAs whose barriers a CTA's loads complete on (2-CTA: the pair leader's)
    bar_of = (lambda r: sync.pair_leader(r, two)) if arch == "sm100a" else (lambda r: r)
    ab = {r: Ring(f"cta{r}.ab_smem", stages, readers=(consumer_warps if arch == "sm90a" else 1)) for r in rank.values()}
    parts_a = [("a", j) for j in range(N)]
    parts_b = [(f"b{x}", i) for x in range(num_b) for i in range(M)]

    # -------------------------------------------------------------- A/B producer (TMA warp)
    def producer(c):
        r = rank[c]
        for j in range(tiles * k_tiles):
            idx, ph = sync.pipeline_state(j, stages, producer=True)
            yield wait(empty[r][idx], ph, j // stages, f"A/B use {j}: its stage released")
            if arch == "sm90a" or c[0] == 0:
                full[r][idx].arrive(tx)                      # arrive.expect_tx
            # this CTA's slice of A, multicast along its row; its slice of B along its column
            for part, mode, nbytes in ([(("a", c[2]), "a", a_bytes // N)]
                                       + [((f"b{x}", c[1]), "b", b_bytes // M) for x in range(num_b)]):
                for d in sync.mask_ranks(sync.mcast_mask(shape, c, mode)):
                    ab[d].check_free(idx, j)
                    sim.later("tma load", lambda d=d, idx=idx, j=j, part=part, nbytes=nbytes: (
                        ab[d].write(idx, j, part), full[bar_of(d)][idx].complete_tx(nbytes)))

    # -------------------------------------------------------------- sm90: consumer warpgroups
    res = {r: Ring(f"cta{r}.residual", sync.RESIDUAL_STAGES, readers=epi_warps) for r in rank.values()}
    in_bar = {r: [sim.barrier(f"cta{r}.in_bar[{i}]", sync.RESIDUAL_ARRIVALS) for i in range(sync.RESIDUAL_STAGES)]
              for r in rank.values()}
    issued = {r: defaultdict(int) for r in rank.values()}      # residual loads per barrier (history)
    need_of = {r: {} for r in rank.values()}
    stores = {r: StoreRing(f"cta{r}.d_smem", store_stages) for r in rank.values()}

    def load_residual(r, g):
        slot = sync.ring_index(g, sync.RESIDUAL_STAGES)
        res[r].check_free(slot, g)
        in_bar[r][slot].arrive(tx=1024)
        issued[r][slot] += 1
        need_of[r][g] = issued[r][slot]
        sim.later("residual tma load", lambda: (res[r].write(slot, g, 0), in_bar[r][slot].complete_tx(1024)))

    def epilogue_tile(r, w, t, warps, key):
        """One tile's epilogue sub-tiles (both archs): residual ring, D staging ring, TMA stores."""
        prev = residual_start(t, n_sub)
        if cfg.get("residual") and w == 0:
            load_residual(r, prev)
        for s in range(n_sub):
            g = prev + s
            if cfg.get("residual"):
                if w == 0 and s + 1 < n_sub:
                    load_residual(r, g + 1)
                slot = sync.ring_index(g, sync.RESIDUAL_STAGES)
                yield ("until", lambda: g in need_of[r])      # (warp 0's issue is program-ordered before)
                yield wait(in_bar[r][slot], sync.ring_phase(g, sync.RESIDUAL_STAGES), need_of[r][g],
                           f"residual sub-tile {g}")
                res[r].read(slot, g, {0})
            buf = sync.ring_index(g, store_stages)
            stores[r].write(buf)
            yield ("sync", key, warps)                        # fence + epi_bar: the sub-tile is in smem
            if cfg.get("residual"):
                res[r].release(slot, g)
            if w == 0:
                st = stores[r]
                st.inflight.append(buf)
                sim.later("tma store", lambda st=st, buf=buf: st.inflight.remove(buf))
                yield ("until", lambda st=st: len(st.inflight) <= st.stages - 1)     # producer_acquire
            yield ("sync", key, warps)
        if w == 0:
            yield ("until", lambda: not stores[r].inflight)  # (the tail: producer_tail waits all)

    def sm90_consumer(c, w):
        r = rank[c]
        j = 0
        for t in range(tiles):
            prev_use = None
            for k in range(k_tiles):
                idx, ph = sync.pipeline_state(j, stages)
                yield wait(full[r][idx], ph, j // stages + 1, f"A/B use {j}")
                ab[r].read(idx, j, parts_a + parts_b)
                if prev_use is not None:                    # release the previous stage after this issue
                    release_sm90(c, *prev_use)
                prev_use = (idx, j)
                j += 1
            release_sm90(c, *prev_use)
            yield from epilogue_tile(r, w, t, consumer_warps, f"cta{r}.epi")

    def release_sm90(c, idx, j):
        ab[rank[c]].release(idx, j)
        for d in sync.sm90_ab_empty_routes(shape)(c):
            empty[d][idx].arrive()

    # -------------------------------------------------------------- sm100: MMA warp and epilogue warps
    if arch == "sm100a":
        acc_full = {r: [sim.barrier(f"cta{r}.acc_full[{i}]", sync.ACC_FULL_ARRIVALS) for i in range(sync.ACC_STAGES)]
                    for r in rank.values()}
        acc_empty = {r: [sim.barrier(f"cta{r}.acc_empty[{i}]", acc_empty_count) for i in range(sync.ACC_STAGES)]
                     for r in rank.values()}
        tmem = {r: Ring(f"pair{r}.tmem_acc", sync.ACC_STAGES, readers=epi_warps * V) for r in rank.values()}

    def mma(c):
        r = rank[c]
        j = 0
        for t in range(tiles):
            ai, aph = sync.pipeline_state(t, sync.ACC_STAGES, producer=True)
            yield wait(acc_empty[r][ai], aph, t // sync.ACC_STAGES, f"accumulator of tile {t} released")
            tmem[r].check_free(ai, t)
            for k in range(k_tiles):
                idx, ph = sync.pipeline_state(j, stages)
                yield wait(full[r][idx], ph, j // stages + 1, f"A/B use {j}")
                pair = [rank[(v, c[1], c[2])] for v in range(V)]
                for p in pair:
                    ab[p].read(idx, j, parts_a + parts_b)
                # tcgen05.commit: arrives when the MMAs reading the stage are done
                sim.later("umma commit", lambda idx=idx, j=j, pair=pair: (
                    [ab[p].release(idx, j) for p in pair],
                    [empty[d][idx].arrive() for d in sync.sm100_ab_empty_routes(shape)(c)]))
                j += 1
            sim.later("acc commit", lambda ai=ai, t=t: (
                tmem[r].write(ai, t, "mma"), [acc_full[d][ai].arrive() for d in sync.acc_full_routes(shape)(c)]))

    def sm100_epilogue(c, w):
        r = rank[c]
        lead = sync.pair_leader(r, two)
        for t in range(tiles):
            ai, aph = sync.pipeline_state(t, sync.ACC_STAGES)
            yield wait(acc_full[r][ai], aph, t // sync.ACC_STAGES + 1, f"accumulator of tile {t}")
            tmem[lead].read(ai, t, {"mma"})
            yield from epilogue_tile(r, w, t, sync.SM100_EPI_WARPS, f"cta{r}.epi")
            yield ("sync", f"cta{r}.epi", sync.SM100_EPI_WARPS)
            tmem[lead].release(ai, t)
            acc_empty[lead][ai].arrive()                     # elected lane of each epilogue warp

    for c in coords:
        r = rank[c]
        sim.agent(f"cta{r}.producer", producer(c))
        if arch == "sm90a":
            for w in range(consumer_warps):
                sim.agent(f"cta{r}.consumer{w}", sm90_consumer(c, w))
        else:
            if c[0] == 0:
                sim.agent(f"cta{r}.mma", mma(c))
            for w in range(sync.SM100_EPI_WARPS):
                sim.agent(f"cta{r}.epilogue{w}", sm100_epilogue(c, w))
    return at


def simulate(arch, seed=0, residual_start=sync.residual_start, **cfg):
    cfg.setdefault("cluster", (1, 1))
    cfg.setdefault("k_tiles", 2)
    sim = Sim(seed)
    build_kernel(sim, arch, cfg, residual_start)
    sim.run()
    return sim


# ------------------------------------------------------------------------------------------ tests
CLUSTERS = {"sm90a": [((1, 1), False, 1), ((2, 1), False, 1), ((1, 2), False, 2), ((2, 2), False, 1)],
            "sm100a": [((1, 1), False, 1), ((2, 1), False, 1), ((1, 2), False, 1), ((2, 1), True, 1),
                       ((4, 1), True, 1), ((2, 2), True, 1), ((4, 2), True, 1)]}
N_SUB = (1, 2, 3, 4, 6, 8)


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_every_barrier_over_stages_clusters_and_tile_counts(arch):
    """The A/B ring (multicast, 2-CTA), the accumulator ring, the residual ring and the store ring
    of one cluster, on random interleavings: 1-8 stages (2-8 on sm_90a, where one deadlocks: see
    below; the planner never picks fewer than 2 on either arch), 1-50 tiles per CTA, 1-3 K tiles."""
    for ci, (cluster, two, wgs) in enumerate(CLUSTERS[arch]):
        for stages in range(1 if arch == "sm100a" else sync.MIN_AB_STAGES, 9):
            for tiles in (1, 2, 5) if stages % 3 else (1, 3, 50):
                for k_tiles in (1, 3):
                    simulate(arch, seed=ci * 1000 + stages * 10 + tiles, cluster=cluster, use_2cta=two, wgs=wgs,
                             stages=stages, tiles=tiles, k_tiles=k_tiles, n_sub=2, residual=True,
                             dual=stages == 4)


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
@pytest.mark.parametrize("n_sub", N_SUB)
def test_residual_ring_over_every_sub_tile_count(arch, n_sub):
    """The residual ring's parities hold over a CTA's whole run whatever the epilogue's sub-tile
    count, from 1 to 50 tiles (the ring's counter runs on across tiles)."""
    for tiles in (1, 2, 3, 4, 7, 50):
        for seed in range(2):
            simulate(arch, seed=seed, stages=3, tiles=tiles, k_tiles=1, n_sub=n_sub, residual=True)


def test_the_simulation_finds_issue_22_item_1_in_the_old_sm100_code():
    """Before the fix, sm100.py read the scheduler's tile count after advance_to_next_work, which
    counts the current tile: the residual ring started at g = n_sub, not 0.  The simulation, given
    that counter, fails for n_sub = 1, 2, 6 (a wait of the wrong parity passes on a barrier whose load
    has not landed, or, if it has, waits for a phase that never comes) and passes for n_sub = 4
    and 8 (the parity happens to be right)."""
    def old(tiles_done, n_sub):
        return (tiles_done + 1) * n_sub          # num_tiles_executed read after advancing
    for n_sub in (1, 2, 6):
        with pytest.raises(ProtocolError, match=r"in_bar\[\d\]"):
            for seed in range(4):
                simulate("sm100a", seed=seed, residual_start=old, stages=3, tiles=3, k_tiles=1, n_sub=n_sub,
                         residual=True)
    for n_sub in (4, 8):
        for seed in range(2):
            simulate("sm100a", seed=seed, residual_start=old, stages=3, tiles=3, k_tiles=1, n_sub=n_sub, residual=True)
    # the epilogue tiles where this happens (issue 22 item 1): n_sub of 64x64, 64x128, 128x64, 128x192
    # f16 tiles is 1, 2, 2, 6; 128x128 and 128x256 have 4 and 8
    subs = {t: sync.sub_tiles(t, sync.sm100_epi_tile(t, False, 16, False)) for t in
            ((64, 64), (64, 128), (128, 64), (128, 192), (128, 128), (128, 256))}
    assert subs == {(64, 64): 1, (64, 128): 2, (128, 64): 2, (128, 192): 6, (128, 128): 4, (128, 256): 8}


def test_one_stage_deadlocks_on_sm90a_which_is_why_the_planner_needs_two():
    """Issue 22 item 2: on sm_90a a stage is released only after the next stage's WGMMA is issued,
    so a one-stage ring deadlocks as soon as a tile has two K tiles; two stages run."""
    with pytest.raises(ProtocolError, match="deadlock"):
        simulate("sm90a", stages=1, tiles=1, k_tiles=2, n_sub=1)
    simulate("sm90a", stages=2, tiles=2, k_tiles=2, n_sub=1)


MUTATIONS = [  # (arch, cluster, 2-CTA, function of sync.py, its wrong version)
    ("sm90a", (2, 2), False, "sm90_ab_empty_arrivals", lambda f: lambda cl, wg: f(cl, wg) - 1),
    ("sm90a", (2, 1), False, "sm90_ab_empty_arrivals", lambda f: lambda cl, wg: f(cl, wg) + 1),
    ("sm100a", (2, 2), False, "sm100_ab_empty_arrivals", lambda f: lambda cl, two: f(cl, two) - 1),
    ("sm100a", (2, 2), True, "sm100_ab_empty_arrivals", lambda f: lambda cl, two: f(cl, two) + 1),
    ("sm100a", (2, 1), True, "sm100_acc_empty_arrivals", lambda f: lambda two: f(two) - 1),
    ("sm100a", (1, 1), False, "sm100_acc_empty_arrivals", lambda f: lambda two: f(two) + 1),
    ("sm90a", (1, 2), False, "ab_stage_tx_bytes", lambda f: lambda *a: f(*a) - 64),
    ("sm100a", (2, 1), True, "ab_stage_tx_bytes", lambda f: lambda a, b, nb, two=False: f(a, b, nb, False)),
    ("sm100a", (1, 1), False, "ring_phase", lambda f: lambda c, s: f(c + 1, s)),
    ("sm90a", (1, 1), False, "pipeline_state", lambda f: lambda c, s, producer=False: f(c, s, not producer)),
]


@pytest.mark.parametrize("arch,cluster,two,name,wrong", MUTATIONS, ids=[f"{m[0]}-{m[3]}-{i}" for i, m in enumerate(MUTATIONS)])
def test_the_simulation_catches_wrong_arithmetic(monkeypatch, arch, cluster, two, name, wrong):
    """The simulation is sensitive to each piece of the arithmetic: an arrive count one too low lets
    a buffer be refilled while another CTA or warp still reads it, one too high deadlocks; a
    wrong transaction byte count completes a phase before its data lands (or never); a wrong
    phase or a producer/consumer phase swap passes a wait early or never."""
    monkeypatch.setattr(sync, name, wrong(getattr(sync, name)))
    with pytest.raises(ProtocolError):
        for seed in range(12):
            simulate(arch, seed=seed, cluster=cluster, use_2cta=two, stages=2, tiles=4, k_tiles=3, n_sub=3,
                     residual=True)


def test_closed_form_arrive_counts_match_the_enumerated_routing():
    """The counts the kernels pass (closed forms) equal the ones derived by enumerating which CTA's
    signal lands on which barrier (what the kernels check at trace time), for every cluster shape
    the planner allows."""
    for cm in (1, 2, 4, 8):
        for cn in (1, 2, 4, 8):
            if cm * cn > 8:
                continue
            for wgs in (1, 2):
                shape = (1, cm, cn)
                assert sync.sm90_ab_empty_arrivals((cm, cn), wgs) == sync.routed_arrivals(
                    shape, sync.sm90_ab_empty_routes(shape), warps=4 * wgs)
            for two in (False, True) if cm % 2 == 0 else (False,):
                shape = sync.cluster_vmn((cm, cn), two)
                assert sync.sm100_ab_empty_arrivals((cm, cn), two) == sync.routed_arrivals(
                    shape, sync.sm100_ab_empty_routes(shape), warps=1)
                assert sync.sm100_acc_empty_arrivals(two) == sync.routed_arrivals(
                    shape, sync.to_pair_leader_routes(shape), warps=4)
                assert sync.routed_arrivals(shape, sync.acc_full_routes(shape), warps=1) == sync.ACC_FULL_ARRIVALS
    # a count that differs between CTAs is itself an error
    with pytest.raises(KspecInternalError, match="differ between the CTAs"):
        sync.routed_arrivals((1, 2, 1), lambda c: [0, 1] if c[1] == 0 else [1], warps=1)


# ------------------------------------------------------------------------------------------ the kernels' use
def _residual_start_reads(path):
    """(line of the tile-count read, line of advance_to_next_work) in every persistent-tile loop of
    a kernel source that computes the residual ring's start."""
    import ast
    tree = ast.parse(path.read_text())
    out = []
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.While)):
        nodes = [n for stmt in loop.body for n in ast.walk(stmt)]
        calls = [n for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "residual_start"]
        if not calls:
            continue
        arg = calls[0].args[0]
        if isinstance(arg, ast.Attribute):           # sched.num_tiles_executed read in place
            assert arg.attr == "num_tiles_executed"
            read = arg.lineno
        else:                                        # a name assigned from it earlier in the loop
            read = min(n.lineno for n in nodes if isinstance(n, ast.Assign)
                       and any(getattr(t, "id", None) == arg.id for t in n.targets)
                       and getattr(n.value, "attr", "") == "num_tiles_executed")
        advance = min(n.lineno for n in nodes if isinstance(n, ast.Call)
                      and getattr(n.func, "attr", "") == "advance_to_next_work")
        out.append((read, advance))
    return out


@pytest.mark.parametrize("kernel", ["sm90.py", "sm100.py"])
def test_both_kernels_start_the_residual_ring_from_the_count_before_advancing(kernel):
    """Issue 22 item 1 in the kernel source: the residual ring's start (sync.residual_start) takes
    the scheduler's tile count read before advance_to_next_work in the same loop (the DSL's static
    persistent scheduler counts the current tile inside advance_to_next_work; sm_100a's epilogue
    advances early, so it keeps the count read before)."""
    from pathlib import Path
    (pair,) = _residual_start_reads(Path(sync.__file__).parent / kernel)
    assert pair[0] < pair[1], pair


# ------------------------------------------------------------------------------------------ the stage bound
BIG_EPILOGUE = """
kernel big_epilogue {
  in  A : f16[M, K]
  in  B : f16[K, N] col
  in  R : f32[M, N]
  out H : f32[M, N]
  out D : f32[M, N]

  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  H[m, n] = acc[m, n] + R[m, n]
  D[m, n] = gelu(H[m, n])
}
"""


def _big_desc(arch):
    from kspec.backends.desc import Accum, GemmDesc, Load, Op, Operand, Store
    h = Op("add", (Accum(), Load("R", "full", "f32")))
    return GemmDesc("k_0", arch, Operand("A", "f16", "row"), Operand("B", "f16", "col"), "f32",
                    Store("D", Op("gelu", (h,)), "f32"), aux_stores=(Store("H", h, "f32"),))


def test_the_planner_never_picks_fewer_than_two_ab_stages():
    """Issue 22 item 2: a 128x256 sm_90a tile with an f32 D, an f32 aux output and an f32 residual
    leaves one A/B stage (0 with more epilogue): the planner computes the stage count with the
    kernel's own function and refuses it (the setting at fault: the tile); the heuristic picks the
    largest tile that keeps two stages; every candidate it offers keeps two."""
    from kspec.backends.cute import gemm
    d = _big_desc("sm90a")
    wide = gemm.CuteConfig((128, 256), (2, 1))
    assert gemm.smem_budget(d, "sm90a", wide).stages == 1
    p = gemm.config_problem(wide, "sm90a", desc=d)
    assert p.setting == "tile" and "only 1 A/B pipeline stage(s) of 49,152 B" in p.reason, p.reason
    assert "needs at least 2" in p.reason
    assert gemm.config_problem(wide, "sm90a") is None            # without the epilogue: a fine shape
    for arch in ("sm90a", "sm100a"):
        d = _big_desc(arch)
        cands = gemm.candidates(d, arch)
        assert cands and all(gemm.smem_budget(d, arch, c).stages >= sync.MIN_AB_STAGES for c in cands)
        big = gemm.default_config(d, arch, {"M": 8192, "N": 8192})
        assert gemm.smem_budget(d, arch, big).stages >= sync.MIN_AB_STAGES and big in cands
    assert gemm.default_config(_big_desc("sm90a"), "sm90a", {"M": 8192, "N": 8192}).tile == (128, 128)
    # a user's stage cap below the bound is refused as before; one above is capped by what fits
    d90 = _big_desc("sm90a")
    assert "at least 2" in gemm.valid_config(gemm.CuteConfig((128, 128), stages=1), "sm90a", desc=d90)
    assert gemm.smem_budget(d90, "sm90a", gemm.CuteConfig((128, 128), stages=3)).stages == 3


def test_a_gemm_no_tile_fits_is_declined_with_the_arithmetic():
    """An epilogue so large that even a 64x64 tile keeps under two stages: the CuTe DSL backend
    declines the GEMM (another backend builds it), saying how the shared memory is split."""
    from kspec.backends.cute import gemm
    from kspec.backends.desc import Accum, GemmDesc, Load, Op, Operand, Store
    v = Accum()
    for i in range(4):
        v = Op("add", (v, Load(f"R{i}", "full", "f32")))
    aux = tuple(Store(f"X{i}", Op("mul", (v, Load(f"R{i}", "full", "f32"))), "f32") for i in range(4))
    for arch in ("sm90a", "sm100a"):
        d = GemmDesc("k_0", arch, Operand("A", "f16", "row"), Operand("B", "f16", "col"), "f32",
                     Store("D", v, "f32"), aux_stores=aux)
        why = gemm.can_implement(d, arch)
        assert why and why.startswith("no CuTe DSL tile fits: at tile=64x64") and "0 A/B pipeline stage" in why, why


def test_graph_refuses_a_pinned_tile_below_the_bound_and_plans_a_fitting_one(tmp_path, capsys):
    """What `kspec graph` prints is what the kernel can run: pinned to the CuTe DSL backend, the
    128x256 sm_90a tile is a located error at the tile setting; unpinned, CUTLASS C++ takes the
    hint and the CuTe DSL backend's reason is printed; with no hint, 128x128 is planned."""
    from kspec.cli import main
    spec = tmp_path / "big.kspec"
    spec.write_text(BIG_EPILOGUE + "schedule big_epilogue for sm90a { tile = 128x256x64  backend = cute }\n")
    rc = main(["graph", str(spec)])
    out, err = capsys.readouterr()
    assert rc == 1 and "tile = 128x256x64" in err and "only 1 A/B pipeline stage(s)" in err, err
    assert "big.kspec:" in err                                   # located at the setting
    spec.write_text(BIG_EPILOGUE)
    assert main(["graph", str(spec), "--sizes", "M=8192,N=8192,K=4096"]) == 0
    out, err = capsys.readouterr()
    assert "sm90a: cute gemm (tile=128x128 cluster=1x1" in out, out
    assert "sm100a: cute gemm (tile=128x128" in out, out


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_the_largest_epilogue_compiles_and_its_shared_memory_fits(arch):
    """The planner's configuration for the big epilogue compiles (the kernel's trace-time checks:
    its shared-memory split and stage count equal sync.smem_budget's, the DSL's own tile sizes agree,
    every arrive count and byte count matches the derived one), and the dynamic shared memory the
    DSL's launcher asks for holds the budget's stages and fits the opt-in limit."""
    from kspec.backends.cute import build as cbuild
    from kspec.backends.cute import gemm
    from kspec.runtime.glue import HostGlue
    d = _big_desc(arch)
    for cfg in {gemm.default_config(d, arch, {"M": 8192, "N": 8192}), gemm.default_config(d, arch, {"M": 32, "N": 8192})}:
        b = cbuild.build(d, arch, test_cache_root(), cfg)
        budget = gemm.smem_budget(d, arch, cfg)
        pr = HostGlue(b.host, "big").prepare([4096, 4096, 256, 1], [(i + 1) << 24 for i in range(5)], [], 0, 0, 132)
        used = budget.stages * budget.ab_stage_bytes + budget.epi_bytes + budget.in_bytes
        assert used <= pr.smem_bytes <= sync.SMEM_CAPACITY, (cfg, budget, pr.smem_bytes)


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch,name", [("sm90a", "sm90_ab_empty_arrivals"), ("sm100a", "sm100_ab_empty_arrivals"),
                                       ("sm100a", "sm100_acc_empty_arrivals"), ("sm90a", "ab_stage_tx_bytes")])
def test_a_wrong_count_fails_the_compile_with_the_arithmetic(monkeypatch, tmp_path, arch, name):
    """Trace-time arrive-count checks (as QuACK's pipeline_checks, kspec's own rules): the count the
    kernel passes to a pipeline constructor is compared with the one derived from the warp roles and
    the cluster routing; one off fails the compile with a KspecInternalError that spells it out."""
    from kspec.backends.cute import build as cbuild
    from kspec.backends.cute import gemm
    from kspec.backends.desc import Accum, GemmDesc, Operand, Store
    f = getattr(sync, name)
    monkeypatch.setattr(sync, name, lambda *a, **k: f(*a, **k) + 1)
    d = GemmDesc("k_0", arch, Operand("A", "f16", "row"), Operand("B", "f16", "col"), "f32", Store("D", Accum(), "f16"))
    cfg = gemm.CuteConfig((256, 128), (2, 2), True) if arch == "sm100a" else gemm.CuteConfig((128, 128), (2, 1))
    with pytest.raises(KspecInternalError) as e:
        cbuild.build(d, arch, tmp_path / "cache", cfg)
    msg = str(e.value)
    assert "the kernel passes" in msg and ("arrive count" in msg or "transaction bytes" in msg), msg


def test_two_cta_tiles_of_64_row_ctas_are_not_planned():
    """Issue 22: 2-CTA tiles with 64-row CTAs (an MMA tile of 128 rows) were accepted by the
    configuration check though nothing reached them and their epilogue's strided N sub-tile was never
    checked against its buffer: refused at the tile; 256-row 2-CTA tiles stay."""
    from kspec.backends.cute import gemm
    p = gemm.config_problem(gemm.CuteConfig((128, 128), (2, 1), True), "sm100a")
    assert p.setting == "tile" and "M 256" in p.reason
    assert gemm.valid_config(gemm.CuteConfig((256, 128), (2, 1), True), "sm100a") is None
