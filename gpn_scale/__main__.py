from gpn_scale.cli import main

raise SystemExit(main())
