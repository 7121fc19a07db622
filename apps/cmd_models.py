"""List the built-in models that ``--model`` accepts."""

from __future__ import annotations

import argparse

from apps.output import table

HELP = "list built-in models"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> dict:
    from engine.models import list_models

    models = list_models()
    if not args.json:
        print(table(["model", "description"], sorted(models.items())))
        print("or pass module:callable for your own nn.Module")
    return {"models": models}
