"""List the built-in models that ``--model`` accepts."""

from __future__ import annotations

import argparse
import shutil
import textwrap

HELP = "list built-in models"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> dict:
    from engine.models import list_models

    models = list_models()
    if not args.json:
        print(models_text(models, shutil.get_terminal_size((100, 24)).columns))
    return {"models": models}


def models_text(models: dict[str, str], width: int) -> str:
    """The model names and their descriptions, each wrapped to ``width`` characters (at least 60)
    under a name column as wide as the longest name."""
    width = max(60, int(width))
    names = max(len(n) for n in [*models, "model"])
    indent = " " * (names + 2)
    lines = [f"{'model':<{names}}  description", f"{'-' * names}  {'-' * (width - names - 2)}"]
    for name, text in sorted(models.items()):
        lines += textwrap.wrap(text, width, initial_indent=f"{name:<{names}}  ", subsequent_indent=indent,
                               break_on_hyphens=False) or [name]
    lines.append("or pass module:callable for your own nn.Module")
    return "\n".join(lines)
