from evenrl.cli import main

raise SystemExit(main())
