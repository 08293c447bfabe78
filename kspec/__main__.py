from kspec.cli import main

raise SystemExit(main())
