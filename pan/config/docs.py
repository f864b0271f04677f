"""Generate docs/config.md from the schema: `python -m pan.config.docs --write docs/config.md`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pan.config.job import DEFAULT_RECIPE, components
from pan.config.loader import _type_name, field_types
from pan.recipe import BUILT_IN, get_recipe


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _rows(cls, prefix: str = ""):
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _rows(tp, prefix=f"{prefix}{f.name}.")
            continue
        default = _default(f)
        shown = "null" if default is None else repr(default).replace("'", '"')
        yield f"{prefix}{f.name}", _type_name(tp).replace("|", "\\|"), shown.replace("|", "\\|"), \
            f.metadata.get("help", "")


def shipped_recipes() -> list[str]:
    """The recipes pan ships (plugins from PAN_RECIPE_MODULES are not documented here), the
    default one first."""

    return sorted(BUILT_IN, key=lambda n: (n != DEFAULT_RECIPE, n))


def render_recipe(recipe_name: str) -> list[str]:
    """One recipe's section: its keys, grouped by the YAML section each is listed under."""

    recipe = get_recipe(recipe_name)
    by_section: dict[str, list] = {}
    for cls in components(recipe.job_config).values():
        by_section.setdefault(cls.SECTION, []).extend(_rows(cls))
    lines = [f"## Recipe `{recipe_name}`", "", f"{recipe.description}. `recipe: {recipe_name}`.", ""]
    for section, rows in by_section.items():
        lines += [f"### `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {t} | `{d}` | {h} |" for k, t, d, h in rows]
        lines.append("")
    return lines


def render() -> str:
    """docs/config.md: every shipped recipe's keys, each recipe in its own section."""

    recipes = shipped_recipes()
    lines = [
        "# Config reference",
        "",
        "Generated from the schema by `make docs` (`python -m pan.config.docs --write docs/config.md`);",
        "a test fails when this file is stale. Section names in a YAML file only group keys: any key may",
        "sit in any section (or at the top level), but only once. Any key can be overridden on the",
        "command line: `--key value`, nested `--transformer_config_overrides.num_layers 4`.",
        "",
        f"Top-level key `recipe` (default `{DEFAULT_RECIPE}`) selects the recipe, and the recipe decides "
        "which keys exist:",
        "",
    ]
    lines += [f"- [`{name}`](#recipe-{name}): {get_recipe(name).description}" for name in recipes]
    lines.append("")
    for name in recipes:
        lines += render_recipe(name)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", type=Path, help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        args.write.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
