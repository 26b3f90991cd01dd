from onespark.cli import main

raise SystemExit(main())
