"""`glm53.parallel.export_pretrained` on gloo: a model sharded on dp2 x tp2 writes the official layout from
several ranks at once (no rank gathers the model); from_pretrained reloads it exactly, transformers 5.23.0 loads
it to equal logits, and an existing directory's foreign files survive. Under expert parallelism (dp2 x ep2: experts
Shard(0) over ep, FSDP over dp) the exported files equal the source checkpoint.

The exporter's bookkeeping written out (one process): writer ranks largest key first to the least-loaded rank,
and an export equals `save_pretrained` of the same model: the same tensors and dtypes (bf16 with the fp32
keep-list), the index's total_size, config.json's dtype, files cut at the shard size. On gloo, one rank failing
inside the shared directory fails every rank and leaves nothing behind.

Legend: sizes are bytes per official key; a writer is the rank that writes a key.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.parallel.export import assign_writers, export_pretrained
from tests.helpers.checkpoints import read_all
from tests.helpers.ckpt_jobs import load_and_export, write_test_checkpoint
from tests.helpers.export_edges_jobs import failing_write

SHARD = 60_000  # bytes per file: several files per writer rank


def test_export_from_2x2_reloads_exactly_and_in_transformers(pool4, tmp_path):
    init = str(tmp_path / "init")
    state = write_test_checkpoint(init, fp8_blocks=False)
    out = tmp_path / "export"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # a foreign file, kept as save_pretrained keeps it
    results = pool4.run(load_and_export, init=init, out=str(out), dp=2, tp=2, max_shard_size=SHARD)
    written = read_all(str(out))
    assert set(written) == set(state)
    assert all(torch.equal(written[k], state[k]) for k in state)
    assert (out / "tokenizer.json").read_text() == "{}"
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(files) and len(files) > 4
    largest = max(v.nbytes for v in state.values())
    assert all(r["pending"] <= SHARD + largest for r in results)  # no rank held more than one file's worth

    ours = Glm53ForCausalLM.from_pretrained(out, dtype=torch.float32)
    from transformers import Glm5NextForConditionalGeneration

    hf, info = Glm5NextForConditionalGeneration.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["mismatched_keys"]
    assert all(k.startswith("model.visual.") for k in info["missing_keys"]), info["missing_keys"]
    hf.eval()
    ids = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_export_from_dp2_ep2_equals_the_source(pool4, tmp_path):
    init = str(tmp_path / "init")
    state = write_test_checkpoint(init, fp8_blocks=False)
    out = tmp_path / "export"
    results = pool4.run(load_and_export, init=init, out=str(out), dp=2, tp=1, ep=2, max_shard_size=SHARD)
    written = read_all(str(out))
    assert set(written) == set(state)
    bad = [k for k in state if not torch.equal(written[k], state[k])]
    assert not bad, bad[:5]
    largest = max(v.nbytes for v in state.values())
    assert all(r["pending"] <= SHARD + largest for r in results)


def test_export_over_a_checkpoint_keeps_foreign_files(tmp_path):
    """Overwriting replaces only the checkpoint's own files (issue 11's rule, also for the torchrun export and the
    DCP run directory): a user's adapter, README, symlink and subdirectory stay byte-identical."""
    from glm53 import Glm53Config
    from glm53.parallel import export_pretrained

    model = Glm53ForCausalLM(Glm53Config.tiny())
    target = tmp_path / "ckpt"
    model.save_pretrained(target, max_shard_size="20KB")  # several shards: the stale ones must go
    assert len(list(target.glob("model-*.safetensors"))) > 1
    (target / "adapter_model.safetensors").write_bytes(b"adapter bytes")
    (target / "README.md").write_text("mine")
    (target / "notes").mkdir()
    (target / "notes" / "a.txt").write_text("kept")
    os.symlink(target / "README.md", target / "link.md")
    export_pretrained(model, target, overwrite=True)  # one shard now
    assert (target / "adapter_model.safetensors").read_bytes() == b"adapter bytes"
    assert (target / "README.md").read_text() == "mine" and (target / "notes" / "a.txt").read_text() == "kept"
    assert os.path.islink(target / "link.md")
    assert not list(target.glob("model-*.safetensors"))  # the old checkpoint's shards are gone
    torch.testing.assert_close(Glm53ForCausalLM.from_pretrained(target).lm_head.weight, model.lm_head.weight)
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises((FileExistsError, NotADirectoryError, ValueError)):
        export_pretrained(model, regular, overwrite=True)
    assert regular.read_text() == "x"


# -------------------------------------------------------------------------------------------------- export at its edges
def test_writers_take_the_largest_keys_first_each_to_the_least_loaded_rank():
    # 10 -> r0, 9 -> r1, 8 -> r1 (9 < 10), then the 1s to r0 (10, 11 < 17); ties go to the lowest rank
    assert assign_writers([10, 1, 1, 9, 8], 2) == [0, 0, 0, 1, 1]
    assert assign_writers([5, 5, 5], 3) == [0, 1, 2]
    assert assign_writers([4, 4], 1) == [0, 0]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-is", "bf16"])
def test_export_equals_save_pretrained(tmp_path, dtype):
    model = Glm53ForCausalLM(Glm53Config.tiny())
    shard = 30_000
    model.save_pretrained(tmp_path / "saved", max_shard_size=shard, dtype=dtype)
    export_pretrained(model, tmp_path / "exported", max_shard_size=shard, dtype=dtype)
    saved, exported = read_all(str(tmp_path / "saved")), read_all(str(tmp_path / "exported"))
    assert set(exported) == set(saved)
    for key, value in saved.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in saved.values())
    files = {}
    for key, file in index["weight_map"].items():
        files[file] = files.get(file, 0) + exported[key].nbytes
    largest = max(v.nbytes for v in saved.values())
    assert len(files) > 2 and all(size <= max(shard, largest) for size in files.values())
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    expected = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == expected["dtype"]
    assert config["dtype"] == ("bfloat16" if dtype else "float32")


def test_one_failing_rank_fails_every_rank_and_leaves_nothing(pool2, tmp_path):
    """The ranks agree before rank 0 renames: a directory missing one rank's files never appears."""
    path = tmp_path / "run"
    seen = pool2.run(failing_write, path=str(path), failing_rank=1)
    assert seen[1] == "ValueError: rank 1 failed"
    assert seen[0].startswith("RuntimeError: another rank failed while writing"), seen
    assert not path.exists() and os.listdir(tmp_path) == []


def test_export_as_fp16_beyond_its_range_is_refused_before_writing(tmp_path):
    """A value fp16 cannot hold (1e5 > 65504) is a CheckpointError naming the tensor, and nothing is written (the
    export would hold inf, which from_pretrained refuses); the fp32 keep-list (A_log, norms...) is not cast, and
    bf16 holds the value."""
    from glm53.errors import CheckpointError

    torch.manual_seed(0)
    model = Glm53ForCausalLM(Glm53Config.tiny())
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = 1e5
    target = tmp_path / "fp16"
    with pytest.raises(
        CheckpointError, match=r"exporting as float16 .*layers\.0\.mlp\.up_proj\.weight \(max \|x\| 1e\+05\)"
    ):
        export_pretrained(model, target, dtype=torch.float16)
    assert not target.exists()
    export_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert (tmp_path / "bf16" / "config.json").is_file()
