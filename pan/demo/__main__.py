"""`python -m pan.demo [--recipe NAME]`: a recipe's demo, the default recipe's by default (`make demo`)."""

from pan.demo.main import main

raise SystemExit(main())
