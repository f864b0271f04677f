"""`make demo` / `pan demo [--recipe NAME] [options]`: run a recipe's tiny end-to-end CPU demo, the
default recipe's unless --recipe names another.

    python -m pan.cli demo [--recipe NAME] [--out DIR] [--steps N] [--seed N] [--quick]

Each demo is its recipe's `demo` hook (pan/recipe.py; the built-in ones in pan/recipes/<name>/demo.py,
docs/demo.md and docs/demo_recipes.md): it reads the rest of the command line itself, and writes its
data, run, samples and report under its own `--out`.
"""

from __future__ import annotations

import argparse

from pan.config.job import DEFAULT_RECIPE
from pan.recipe import get_recipe, recipe_names


def recipes_with_demos() -> list[str]:
    """The default recipe, then every other recipe whose Recipe names a demo."""
    return sorted((name for name in recipe_names() if get_recipe(name).demo), key=lambda name: name != DEFAULT_RECIPE)


def dispatch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan demo", add_help=False, description=__doc__.split("\n\n")[0],
                                     usage="pan demo [--recipe NAME] [the options of that recipe's demo]")
    parser.add_argument("--recipe", choices=recipes_with_demos(), default=DEFAULT_RECIPE,
                        help=f"whose demo to run (default: {DEFAULT_RECIPE}; docs/demo.md, docs/demo_recipes.md); "
                             "its options follow")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = dispatch_parser()
    args, rest = parser.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):  # then the demo's own help, from its parser
        print(parser.format_help())
    return get_recipe(args.recipe).hook("demo")(rest)  # the recipe's `demo` hook (pan/recipe.py)


if __name__ == "__main__":
    raise SystemExit(main())
