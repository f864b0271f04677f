"""`python -m pan.demo`: the Pan demo (`make demo`)."""

from pan.demo.main import main

raise SystemExit(main())
