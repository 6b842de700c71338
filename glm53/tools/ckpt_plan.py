"""`python -m glm53.tools.ckpt_plan`: what sharded checkpoint loading and export cost per rank at scale.

    python -m glm53.tools.ckpt_plan --dp 8 --tp 8 --ranks 0,63        # the released config, 64 ranks
    python -m glm53.tools.ckpt_plan --config path/to/config.json --dp 16 --tp 8

Builds the model on the meta device as each listed rank of a fake process group (no data, no devices), and
prints the bytes `glm53.parallel.load_pretrained` would read from the FP8 release layout on that rank, the
rank's parameter shard in memory, and the export's peak on it (shard + one official tensor gathered in fp32 + the
file being filled), beside what gathering the full fp32 model and AdamW state (12 bytes per parameter) costs.
Legend: dp/tp the mesh dimensions; GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

from ..checkpoint.shards import parse_size
from ..config import Glm53Config
from ..errors import Glm53Error
from ..losses import Glm53ForCausalLM
from ..parallel.ckpt_plan import plan_rank
from ..parallel.tensor_parallel import check_tp_size
from ..training.args import positive_int
from ..vision.model import model_class_for

GB = 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53.tools.ckpt_plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a config.json (default: the released config, glm53's defaults)")
    p.add_argument("--dp", type=positive_int, default=8)
    p.add_argument("--tp", type=positive_int, default=8)
    p.add_argument("--ranks", type=_rank_list, default="0,-1", help="comma-separated ranks to plan (-1: the last)")
    p.add_argument("--num-layers", type=positive_int, help="override num_hidden_layers (a quicker, smaller plan)")
    p.add_argument("--max-shard-size", type=_size, default="5GB", help="export file size (the writer's buffer)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    world = args.dp * args.tp
    outside = [r for r in args.ranks if not -world <= r < world]
    if outside:
        p.error(f"argument --ranks: {outside} outside the {world} ranks of --dp {args.dp} x --tp {args.tp}")
    ranks = [world + r if r < 0 else r for r in args.ranks]
    try:
        config = Glm53Config.from_pretrained(args.config) if args.config else Glm53Config()
        if args.num_layers:
            config = Glm53Config(
                **{
                    **_fields(config),
                    "num_hidden_layers": args.num_layers,
                    "layer_types": None,
                    "mlp_layer_types": None,
                    "indexer_types": None,
                },
                extra={"_outer": config.extra.get("_outer", {})},
            )  # a vision tower stays
    except (Glm53Error, OSError) as e:
        print(f"{p.prog}: error: --config {args.config}: {e}", file=sys.stderr)
        return 1
    try:  # heads, KDA heads and the vocabulary must split over tp: said before any planning, as parallelize says it
        check_tp_size(SimpleNamespace(config=config), args.tp)
    except ValueError as e:
        p.error(f"argument --tp: {e}")
    file_bytes = args.max_shard_size
    print(
        f"{config.num_hidden_layers} layers, {config.n_routed_experts} experts, dp {args.dp} x tp {args.tp} "
        f"= {world} ranks (meta device, fake process group)"
    )
    print(
        f"{'rank':>5} {'load reads GB':>14} {'of ckpt':>8} {'replicated GB':>14} {'shard GB':>9} {'export peak GB':>15}"
    )
    params = None
    for rank in ranks:
        plan = plan_rank(config, rank, args.dp, args.tp)
        peak = plan.shard_bytes + plan.largest_key_bytes + file_bytes
        print(
            f"{rank:>5} {plan.read_bytes / GB:>14.2f} {plan.read_bytes / plan.checkpoint_bytes:>8.2%} "
            f"{plan.replicated_bytes / GB:>14.4f} {plan.shard_bytes / GB:>9.2f} {peak / GB:>15.2f}"
        )
        params = plan
    if params is not None:
        n = sum(p.numel() for p in _meta_model(config).parameters())
        print(
            f"checkpoint {params.checkpoint_bytes / GB:.1f} GB (FP8 layout); largest official tensor "
            f"{params.largest_key_bytes / GB:.2f} GB in fp32; {n / 1e9:.1f}B parameters: gathering the fp32 model "
            f"and AdamW state on a rank would take {12 * n / GB:,.0f} GB"
        )
    return 0


def _rank_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer ranks, got {text!r}") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fields(config: Glm53Config) -> dict:
    return {k: getattr(config, k) for k in Glm53Config.__dataclass_fields__ if k != "extra"}


def _meta_model(config: Glm53Config) -> Glm53ForCausalLM:
    with torch.device("meta"):
        return model_class_for(config)(config)


if __name__ == "__main__":
    sys.exit(main())
