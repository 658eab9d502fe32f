from magicdec.cli import main

raise SystemExit(main())
