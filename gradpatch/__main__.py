from gradpatch.cli import main

raise SystemExit(main())
