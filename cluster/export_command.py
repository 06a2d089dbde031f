"""``raylastic export CHECKPOINT OUT.pt``: a sharded checkpoint as one plain state-dict file."""

from __future__ import annotations

import argparse

from rich.console import Console


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export", help="write a checkpoint's model as a plain state dict",
        description="Read a checkpoint directory (any strategy, any world size) and write the model's full "
        "parameters as one torch.save file: torch.load(OUT, weights_only=True) then model.load_state_dict(...).")
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/NAME/checkpoints/step_00000300 "
                        "(async_ps: ps_00000300)")
    parser.add_argument("output", help="the .pt file to write")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from raylastic.actors.async_ps.checkpoints import cut_in
    from raylastic.actors.async_ps.server_files import model_state
    from raylastic.strategies.export import export_model, load_full_model_state

    try:
        cut = cut_in(args.checkpoint)  # async_ps's servers' files (ps_<version>), or a synchronous run's checkpoint
        state = model_state(cut) if cut is not None else load_full_model_state(args.checkpoint)
        path = export_model(state, args.output)
    except (ValueError, OSError) as error:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {error}", highlight=False)
        return 1
    print(f"wrote {path}")
    return 0
