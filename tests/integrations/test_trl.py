"""TRL on RoundPipe: the fused LM head's per-token fields, `RoundPipeSFTTrainer`, `RoundPipeDPOTrainer`,
`RoundPipeKTOTrainer`, `RoundPipeGRPOTrainer` and an unedited TRL script under the launcher, each against the plain
TRL run (tiny float64 Llama, two CPU workers). TRL's own fused head accumulates in float32 whatever the model's
dtype, so the trainer comparisons are at float32 tolerance; the per-token fields and their gradients are also
checked against plain float64 PyTorch, tightly."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_SCRIPT = os.path.join(REPO, "tests", "assets", "trl_sft_script.py")
ROUNDPIPE_ENV = {
    "ROUNDPIPE_DEVICES": "cpu,cpu",
    "ROUNDPIPE_NUM_MICROBATCHES": "2",
    "ROUNDPIPE_ASYNC_OPTIMIZER": "false",
}
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy")
DPO_LOGGED = (
    "loss",
    "grad_norm",
    "logps/chosen",
    "logps/rejected",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logits/chosen",
)


@pytest.fixture
def trl():
    return pytest.importorskip("trl", reason="TRL is not installed (pip install trl; it is in the test extras)")


@pytest.fixture
def roundpipe_env(monkeypatch):
    for name, value in ROUNDPIPE_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def tokenizer():
    from accelerate_roundpipe.tiny.data import build_tokenizer

    return build_tokenizer()


def tiny_model(tokenizer):
    from transformers import LlamaForCausalLM

    from accelerate_roundpipe.tiny.data import tiny_llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(len(tokenizer))).to(torch.float64)


def texts(count: int = 16) -> list[str]:
    from accelerate_roundpipe.tiny.data import split_paragraphs

    return split_paragraphs()[0][:count]


def common_args(output_dir) -> dict:
    return dict(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        learning_rate=1e-3,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )


def logged(trainer, keys) -> list[list[float]]:
    return [[entry[k] for k in keys] for entry in trainer.state.log_history if "loss" in entry]


def assert_logs_close(ours, theirs, what: str, rtol: float = 2e-5, atol: float = 1e-6) -> None:
    assert len(ours) == len(theirs) == 3, (what, ours, theirs)
    torch.testing.assert_close(
        torch.tensor(ours, dtype=torch.float64),
        torch.tensor(theirs, dtype=torch.float64),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: {m}\nours   {ours}\ntheirs {theirs}",
    )


# ---------------------------------------------------------------------- the fused LM head's per-token fields


def test_fused_lm_head_fields_and_gradients_match_plain_float64(trl, tokenizer):
    """`model(..., labels, fused_lm_head=True)` on RoundPipe (TRL's head added first, as TRL does) gives every field of
    TRL's output, equal in float64 to the same quantities from the plain model's logits, and a DPO-like loss of them
    back-propagates to the plain gradients; TRL's own (float32-accumulating) head agrees at float32 precision."""
    from trl.trainer.utils import add_fused_lm_head

    from accelerate_roundpipe import RoundPipeConfig, wrap_model

    plain = tiny_model(tokenizer)
    model = copy.deepcopy(plain)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    try:
        generator = torch.Generator().manual_seed(1)
        input_ids = torch.randint(4, len(tokenizer), (4, 12), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 9:] = 0  # right padding
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :4] = -100  # the prompt
        batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

        def dpo_like(log_probs):  # nonlinear in the per-sequence sums, as DPO's loss is
            sums = log_probs.sum(1)
            return -torch.nn.functional.logsigmoid(0.1 * (sums[0::2] - sums[1::2])).mean()

        ours = model(**batch, fused_lm_head=True)
        dpo_like(ours.log_probs).backward()
        engine.synchronize()

        logits = plain(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        shifted = labels[:, 1:]
        mask = shifted != -100
        log_p = logits.log_softmax(-1)
        expected = {
            "log_probs": log_p.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask,
            "entropy": -(log_p.exp() * log_p).sum(-1) * mask,
            "log_sum_sq_probs": torch.logsumexp(2 * log_p, -1).detach() * mask,
            "mean_logits": logits.mean(-1).detach() * mask,
        }
        for name, value in expected.items():
            torch.testing.assert_close(
                getattr(ours, name).detach(),
                value.detach(),
                rtol=1e-10,
                atol=1e-10,
                msg=lambda m, name=name: f"{name}: {m}",
            )
        assert torch.equal(ours.is_top1, (logits.argmax(-1) == shifted) & mask)
        assert torch.equal(ours.label_mask, mask)
        torch.testing.assert_close(ours.loss, -expected["log_probs"].sum() / mask.sum(), rtol=1e-12, atol=0)

        dpo_like(expected["log_probs"]).backward()
        grads = dict(engine.named_parameters())
        for name, p in plain.named_parameters():
            torch.testing.assert_close(
                grads[name].grad, p.grad, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"grad of {name}: {m}"
            )

        trl_model = copy.deepcopy(plain)
        add_fused_lm_head(trl_model, outputs=("log_probs", "entropy", "is_top1"))
        with torch.no_grad():
            theirs = trl_model(**batch, fused_lm_head=True)
        torch.testing.assert_close(ours.log_probs.detach(), theirs.log_probs.double(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.entropy.detach(), theirs.entropy.double(), rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


# ---------------------------------------------------------------------- SFT


def sft_run(trainer_class, trl, tokenizer, output_dir, **config):
    dataset = __import__("datasets").Dataset.from_dict({"text": texts()})
    args = trl.SFTConfig(**common_args(output_dir), max_length=32, **config)
    trainer = trainer_class(model=tiny_model(tokenizer), args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer


def test_roundpipe_sft_trainer_gives_the_plain_sft_run(trl, tokenizer, roundpipe_env, tmp_path):
    """`RoundPipeSFTTrainer`: TRL's losses, gradient norms, entropies and token accuracies of the plain run, with
    RoundPipe's metrics beside them (proof that the engine trained)."""
    from accelerate_roundpipe.integrations.trl import RoundPipeSFTTrainer

    plain = sft_run(trl.SFTTrainer, trl, tokenizer, tmp_path / "plain")
    ours = sft_run(RoundPipeSFTTrainer, trl, tokenizer, tmp_path / "rp")
    assert ours.roundpipe_engine is not None
    assert_logs_close(logged(ours, LOGGED), logged(plain, LOGGED), "SFT losses, grad norms, entropy, accuracy")
    assert any("roundpipe/host_rss_gib" in entry for entry in ours.state.log_history)


def test_packed_sft_gives_the_plain_packed_run(trl, tokenizer, roundpipe_env, tmp_path):
    """`packing=True` (padding-free batches: restarting `position_ids` plus flash attention's `cu_seq_lens_*`,
    `max_length_*` and `seq_idx`, which say the same packing): the plain packed run's logs. Before, every step was
    refused: `TypeError: unexpected batch keys for the RoundPipe engine: ['cu_seq_lens_k', ...]`."""
    from accelerate_roundpipe.integrations.trl import RoundPipeSFTTrainer

    plain = sft_run(trl.SFTTrainer, trl, tokenizer, tmp_path / "plain", packing=True)
    ours = sft_run(RoundPipeSFTTrainer, trl, tokenizer, tmp_path / "rp", packing=True)
    assert_logs_close(logged(ours, LOGGED), logged(plain, LOGGED), "packed SFT losses, grad norms, entropy, accuracy")
    engine = ours.roundpipe_engine
    ids = torch.arange(4, 12).view(1, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        engine.module.eval()
        with pytest.raises(ValueError, match="describes another packing than `position_ids`"):
            engine.module(input_ids=ids, position_ids=positions, cu_seq_lens_q=torch.tensor([0, 4, 8]))
    engine.close()


def test_overridden_compute_loss_runs_on_the_workers(trl, tokenizer, roundpipe_env, tmp_path):
    """A subclass with its own `compute_loss` (the model's own loss through `model(**inputs)`): the device copies of
    the head no longer deep-copy TRL's patched forward (and the engine behind it), and the losses are the plain
    run's."""
    from accelerate_roundpipe.integrations.trl import RoundPipeSFTTrainer

    def own_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        keys = ("input_ids", "attention_mask", "labels")
        return model(**{k: inputs[k] for k in keys}, num_items_in_batch=num_items_in_batch).loss

    plain = sft_run(
        type("PlainOwnLoss", (trl.SFTTrainer,), {"compute_loss": own_loss}), trl, tokenizer, tmp_path / "plain"
    )
    ours = sft_run(
        type("OursOwnLoss", (RoundPipeSFTTrainer,), {"compute_loss": own_loss}), trl, tokenizer, tmp_path / "rp"
    )
    assert_logs_close(logged(ours, ("loss", "grad_norm")), logged(plain, ("loss", "grad_norm")), "own compute_loss")


def test_unedited_trl_script_under_the_launcher(trl, tokenizer, tmp_path):
    """`python -m accelerate_roundpipe.run trl_sft_script.py ARGS` (a stock SFTTrainer script, in a fresh process so
    TRL is imported after the launcher swapped the Trainer) trains on RoundPipe and logs the losses of the plain
    SFTTrainer run with the same settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_")}
    env.update(
        {
            **ROUNDPIPE_ENV,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HOME": str(tmp_path / "hf_home"),
            "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
        }
    )
    out = str(tmp_path / "rp")
    flags = [f"--{k}={v}" for k, v in common_args(out).items() if k != "report_to"]
    command = [
        sys.executable,
        "-m",
        "accelerate_roundpipe.run",
        SFT_SCRIPT,
        *flags,
        "--report_to=none",
        "--max_length=32",
    ]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stderr[-5000:]}"
    with open(os.path.join(out, "trainer_state.json")) as f:
        ours = [e for e in json.load(f)["log_history"] if "loss" in e]
    plain = sft_run(trl.SFTTrainer, trl, tokenizer, tmp_path / "plain")
    assert_logs_close([[e[k] for k in LOGGED] for e in ours], logged(plain, LOGGED), "launcher vs plain SFTTrainer")
    assert any("roundpipe/host_rss_gib" in e for e in ours)  # RoundPipeTrainer's metrics: the engine trained


# ---------------------------------------------------------------------- DPO


def dpo_dataset():
    from datasets import Dataset

    # Prompts and completions cut on word boundaries, so TRL's tokenization keeps the prompt as a prefix.
    rows = []
    for text in texts():
        words = text.split()
        rows.append(
            dict(prompt=" ".join(words[:6]), chosen=" " + " ".join(words[6:12]), rejected=" " + " ".join(words[12:18]))
        )
    return Dataset.from_list(rows)


def dpo_run(trainer_class, trl, tokenizer, output_dir, **extra):
    model = tiny_model(tokenizer)
    ref_model = copy.deepcopy(model)
    args = trl.DPOConfig(**common_args(output_dir), max_length=48)
    trainer = trainer_class(
        model=model, ref_model=ref_model, args=args, train_dataset=dpo_dataset(), processing_class=tokenizer, **extra
    )
    trainer.train()
    return trainer


def test_roundpipe_dpo_trainer_gives_the_plain_dpo_run(trl, tokenizer, roundpipe_env, tmp_path):
    """`RoundPipeDPOTrainer` with a reference model: the losses, the policy's and (through the rewards, which are
    beta * (policy - reference) log-ratios) the reference model's log-probabilities of the plain run; the reference
    runs on a RoundPipe engine of its own, frozen (no optimizer copies, no gradients)."""
    from accelerate_roundpipe.integrations.convert import engine_of
    from accelerate_roundpipe.integrations.trl import RoundPipeDPOTrainer

    plain = dpo_run(trl.DPOTrainer, trl, tokenizer, tmp_path / "plain")
    ours = dpo_run(RoundPipeDPOTrainer, trl, tokenizer, tmp_path / "rp")
    assert_logs_close(logged(ours, DPO_LOGGED), logged(plain, DPO_LOGGED), "DPO losses, logps, rewards")
    # The rewards of steps 2 and 3 are non-zero, so the reference log-probabilities entered them.
    assert all(abs(entry[1]) > 1e-4 for entry in logged(ours, ("rewards/chosen", "rewards/margins"))[1:])
    ref_engine = engine_of(ours.ref_model)
    assert ref_engine is not None and ref_engine is not ours.roundpipe_engine
    assert not ref_engine._store.trainable_buckets
    assert not any(p.requires_grad for p in ours.ref_model.parameters())


def test_peft_policy_without_reference_gives_the_plain_dpo_run(trl, tokenizer, roundpipe_env, tmp_path):
    """With a PEFT policy and no `ref_model`, TRL takes the reference log-probabilities with the adapters disabled
    (`model.disable_adapter()`): the switch reaches the devices' layer copies ([Note: adapter switches]), so the
    losses, log-probabilities and rewards are the plain run's (rewards non-zero once the adapters have trained)."""
    from peft import LoraConfig, get_peft_model

    from accelerate_roundpipe.integrations.trl import RoundPipeDPOTrainer

    def peft_run(trainer_class, output_dir):
        torch.manual_seed(0)
        model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        args = trl.DPOConfig(**common_args(output_dir), max_length=48)
        trainer = trainer_class(model=model, args=args, train_dataset=dpo_dataset(), processing_class=tokenizer)
        trainer.train()
        return trainer

    plain = peft_run(trl.DPOTrainer, tmp_path / "plain")
    ours = peft_run(RoundPipeDPOTrainer, tmp_path / "rp")
    assert_logs_close(logged(ours, DPO_LOGGED), logged(plain, DPO_LOGGED), "PEFT DPO losses, logps, rewards")
    assert any(abs(entry[1]) > 1e-6 for entry in logged(ours, ("rewards/chosen", "rewards/margins"))[1:])


# ---------------------------------------------------------------------- KTO

KTO_LOGGED = ("loss", "grad_norm", "kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/margins")


def kto_run(trainer_class, trl, tokenizer, output_dir):
    from datasets import Dataset

    rows = []
    for index, text in enumerate(texts()):  # unpaired: each completion desirable or not
        words = text.split()
        rows.append(dict(prompt=" ".join(words[:6]), completion=" " + " ".join(words[6:12]), label=bool(index % 2)))
    model = tiny_model(tokenizer)
    args = trl.KTOConfig(**common_args(output_dir), max_length=48)
    trainer = trainer_class(model=model, ref_model=copy.deepcopy(model), args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    return trainer


def test_roundpipe_kto_trainer_gives_the_plain_kto_run(trl, tokenizer, roundpipe_env, tmp_path):
    """`RoundPipeKTOTrainer` with a reference model: the losses, gradient norms, KL estimate, log-probabilities
    and rewards (which carry the reference's log-probabilities) of the plain run."""
    from accelerate_roundpipe.integrations.convert import engine_of
    from accelerate_roundpipe.integrations.trl import RoundPipeKTOTrainer

    plain = kto_run(trl.KTOTrainer, trl, tokenizer, tmp_path / "plain")
    ours = kto_run(RoundPipeKTOTrainer, trl, tokenizer, tmp_path / "rp")
    assert_logs_close(logged(ours, KTO_LOGGED), logged(plain, KTO_LOGGED), "KTO losses, KL, logps, rewards")
    assert any(abs(entry[1]) > 1e-4 for entry in logged(ours, ("rewards/chosen", "rewards/margins"))[1:])
    assert engine_of(ours.ref_model) is not None and engine_of(ours.ref_model) is not ours.roundpipe_engine


# ---------------------------------------------------------------------- GRPO

GRPO_LOGGED = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy")


def grpo_run(trainer_class, trl, tokenizer, output_dir):
    from datasets import Dataset

    def reward_length(completions, **kwargs):  # nearer 8 words is better
        return [-abs(8 - len(completion.split())) / 8.0 for completion in completions]

    torch.manual_seed(0)
    model = tiny_model(tokenizer)
    args = trl.GRPOConfig(**common_args(output_dir), num_generations=4, generation_batch_size=4,
                          max_completion_length=8, temperature=1.0, beta=0.0)
    prompts = Dataset.from_list([dict(prompt=" ".join(text.split()[:6])) for text in texts(8)])
    trainer = trainer_class(model=model, reward_funcs=reward_length, args=args, train_dataset=prompts,
                            processing_class=tokenizer)
    trainer.train()
    return trainer


def test_roundpipe_grpo_trainer_gives_the_plain_grpo_run(trl, tokenizer, roundpipe_env, tmp_path):
    """`RoundPipeGRPOTrainer`: the completions are sampled through the pipeline (`generate` on the engine), so with
    the same seed they are the plain run's, and so are the rewards, losses and gradient norms."""
    from accelerate_roundpipe.integrations.trl import RoundPipeGRPOTrainer

    plain = grpo_run(trl.GRPOTrainer, trl, tokenizer, tmp_path / "plain")
    ours = grpo_run(RoundPipeGRPOTrainer, trl, tokenizer, tmp_path / "rp")
    assert_logs_close(logged(ours, GRPO_LOGGED), logged(plain, GRPO_LOGGED), "GRPO rewards, losses, grad norms")
    assert any(entry[1] > 0 for entry in logged(ours, GRPO_LOGGED))  # a step with a gradient: the policy trained
    assert ours.roundpipe_engine is not None


# ---------------------------------------------------------------------- without TRL


def test_module_imports_without_trl_and_says_how_to_install(monkeypatch):
    import accelerate_roundpipe.integrations.trl as rp_trl

    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    rp_trl._roundpipe_trl_trainer.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install trl"):
            rp_trl.RoundPipeSFTTrainer  # noqa: B018
    finally:
        rp_trl._roundpipe_trl_trainer.cache_clear()
