"""What a bf16 run saves as its model: the plain Trainer with `bf16=True` trains a float32 model under autocast and
saves float32; RoundPipe computes with bfloat16 compute copies, but the model it saves is the model's own dtype,
written from its float32 optimizer copies ([Note: saved model dtype]): `save_model`, `save_pretrained` after
`unwrap_model`, and `accelerator.get_state_dict` alike."""

from __future__ import annotations

import json
import os

import torch
from test_roundpipe_trainer import close, data, plain_trainer, roundpipe_trainer  # noqa: F401 - `data`: a fixture

STEPS = 2


def _saved(directory: str) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors.torch import load_file

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    return load_file(os.path.join(directory, "model.safetensors")), config.get("dtype", config.get("torch_dtype"))


def test_bf16_run_saves_the_float32_model_like_the_plain_trainer(data, tmp_path):  # noqa: F811
    plain = plain_trainer(data, str(tmp_path / "plain"), bf16=True, max_steps=STEPS)
    plain.train()
    plain.save_model(str(tmp_path / "plain-model"))
    plain_weights, plain_dtype = _saved(str(tmp_path / "plain-model"))
    assert plain_dtype == "float32" and {t.dtype for t in plain_weights.values()} == {torch.float32}
    assert plain.model.dtype == torch.float32  # autocast: the model itself stays float32

    ours = roundpipe_trainer(data, str(tmp_path / "rp"), bf16=True, max_steps=STEPS)
    ours.train()
    engine = ours.roundpipe_engine
    assert engine.module.dtype == torch.bfloat16  # it computed with bfloat16 compute copies
    engine.synchronize()  # the last step may still be in flight on the optimizer thread
    copies = {name: p.detach().clone() for name, p in engine.named_parameters()}
    assert {t.dtype for t in copies.values()} == {torch.float32}

    ours.save_model(str(tmp_path / "save_model"))
    ours.accelerator.unwrap_model(ours.model).save_pretrained(str(tmp_path / "save_pretrained"))
    for how in ("save_model", "save_pretrained"):
        weights, dtype = _saved(str(tmp_path / how))
        assert dtype == plain_dtype, how
        assert weights.keys() == plain_weights.keys(), how
        for name, tensor in weights.items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, copies[name]), (how, name)
    state = ours.accelerator.get_state_dict(ours.model)
    assert state.keys() == plain.accelerator.get_state_dict(plain.model).keys()
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, copies[name]), name
    # Saving changed nothing the run computes with, nor what the user's model says it is.
    assert engine.module.dtype == torch.bfloat16 and engine.module.config.dtype == plain.model.config.dtype
    close(ours)


def test_lora_adapters_are_saved_from_their_float32_optimizer_copies(data, tmp_path):  # noqa: F811
    """PEFT's `save_pretrained` under bfloat16 compute copies writes the adapters as the float32 values trained."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from test_roundpipe_trainer import make_model

    from accelerate_roundpipe import RoundPipeConfig, wrap_model

    tokenizer, train, _ = data
    model = get_peft_model(make_model(len(tokenizer)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, param_dtype="bfloat16"))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad], lr=1e-2))
    model.train()
    for rows in (slice(0, 4), slice(4, 8)):
        engine.forward_backward(**{k: torch.tensor(v) for k, v in train[rows].items()})
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    copies = {name: p.detach().clone() for name, p in engine.named_parameters() if p.requires_grad}
    model.save_pretrained(str(tmp_path))
    saved = load_file(os.path.join(str(tmp_path), "adapter_model.safetensors"))
    assert len(saved) == len(copies) and model.dtype == torch.bfloat16
    for name, tensor in saved.items():
        trained = copies[name.replace(".weight", ".default.weight")]
        assert tensor.dtype == torch.float32 and torch.equal(tensor, trained), name
    engine.close()
