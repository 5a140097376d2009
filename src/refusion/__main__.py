from refusion.cli import main

raise SystemExit(main())
