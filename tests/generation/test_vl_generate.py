"""`glm53 generate --model VL_DIR --image PATH --prompt TEXT` (and --video): the spliced prefill + cached decode
equal greedy decoding with the full VL forward; bad combinations are clear errors."""

from __future__ import annotations

import argparse

import pytest
import torch

from glm53.__main__ import main
from glm53.generation.loop import generate
from glm53.training.data.tokenize import TextTokenizer
from glm53.training.data.vl_records import Media
from glm53.training.data.vl_tokenize import VLEncoder
from glm53.training.vl_finetune import processors
from glm53.training.vl_prompt import vl_prompt
from glm53.vision.model import Glm53ForConditionalGeneration
from tests.helpers.vl_data import tiny_vl_model, vl_tokenizer, write_frames, write_image


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlgen")
    tok = vl_tokenizer()
    ckpt = str(tmp / "model")
    tiny_vl_model(tok, seed=5).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    return tmp, ckpt, write_image(str(tmp / "a.png"), 20, 24, 1), write_frames(str(tmp / "clip"), 4, 16, 16, 2)


def _greedy_full(model, ids, vision: dict, n: int) -> list[int]:
    """Reference: n argmax steps, each a full VL forward (tower + splice + text model) on the whole sequence."""
    out = ids
    for _ in range(n):
        logits = model(out, **vision).logits[:, -1]
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("placeholders", [False, True], ids=["media-first", "placeholders"])
def test_cached_generation_equals_full_forward(vl_dir, placeholders):
    tmp, ckpt, image, clip = vl_dir
    model = Glm53ForConditionalGeneration.from_pretrained(ckpt).eval()
    prompt = "Here <video> and <image>: what?" if placeholders else "what?"
    with torch.no_grad():
        ids, embeds = vl_prompt(model, ckpt, prompt, [image], [clip], 2.0)
    t, row = model.token_ids, ids[0].tolist()
    assert row.count(t.video_start_token_id) == 1 and row.count(t.image_start_token_id) == 3  # 1 image + 2 slices
    # media first: the image leads; with placeholders the video comes first, after "Here "
    assert (row.index(t.video_start_token_id) < row.index(t.image_start_token_id)) == placeholders
    out = generate(model, ids, None, max_new_tokens=4, inputs_embeds=embeds, eos_token_id=[])
    enc = VLEncoder(
        TextTokenizer(ckpt),
        *processors(model, argparse.Namespace(image_min_tokens=16, image_max_tokens=8000, video_max_tokens=240000)),
    )
    spans = [enc.span(Media("image", image, "i"), "t"), enc.span(Media("video", clip, "v", 2.0), "t")]
    vision = dict(
        pixel_values=enc.pixels(spans[0]),
        image_grid_thw=torch.tensor([list(spans[0].grid)]),
        pixel_values_videos=enc.pixels(spans[1]),
        video_grid_thw=torch.tensor([list(spans[1].grid)]),
    )
    with torch.no_grad():
        assert out[0, ids.shape[1] :].tolist() == _greedy_full(model, ids, vision, 4)


def test_cli_streams_an_answer(vl_dir, capsys):
    tmp, ckpt, image, clip = vl_dir
    assert (
        main(
            [
                "generate",
                "--model",
                ckpt,
                "--image",
                image,
                "--video",
                clip,
                "--video-fps",
                "2",
                "--prompt",
                "Describe <image> and <video>.",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("Describe <image> and <video>.") and "4 new tokens" in out


def test_cli_errors(vl_dir, tmp_path, capsys):
    from glm53 import Glm53Config, Glm53ForCausalLM

    tmp, ckpt, image, clip = vl_dir
    assert main(["generate", "--model", ckpt, "--image", image, "--prompt", "<image><image>"]) == 1
    assert "--prompt has 2 <image> placeholders for 1 --image files" in capsys.readouterr().err
    text_only = str(tmp_path / "text")
    Glm53ForCausalLM(Glm53Config.from_pretrained(ckpt)).save_pretrained(text_only)
    with pytest.raises(SystemExit, match="need a vision-language --model; .*text is text-only"):
        main(["generate", "--model", text_only, "--tokenizer", ckpt, "--image", image, "--prompt", "x"])
    with pytest.raises(SystemExit, match="--mtp with --image/--video is not supported"):
        main(["generate", "--model", ckpt, "--image", image, "--prompt", "x", "--mtp", "1"])
    assert main(["generate", "--model", ckpt, "--image", str(tmp_path / "nope.png"), "--prompt", "x"]) == 1
    assert "nope.png: no such image file" in capsys.readouterr().err
