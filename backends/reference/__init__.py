"""numpy reference backend: the semantics every GPU backend is tested against."""
