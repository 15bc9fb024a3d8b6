"""`mlxspec train-drafter`: make teacher data once, train a drafter, save and register it.

Three kinds share the data, the draft vocabulary and the training loop:
- `head`: an EAGLE/MTP-style head reading the target's hidden state (proposer kind head);
- `model`: a small standalone mlx-lm model, the target's first M layers distilled
  (proposer kind draft-model; mlx-lm can use it too);
- `exit`: an exit head after the target's first L layers (proposer kind self-spec);
- `medusa`: K Medusa heads on the target's last hidden state (proposer kind medusa);
- `block`: a block drafter in z-lab's DFlash layout, drafting a block in one pass from
  the target's last layer (proposer kind block).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from mlxspec import device
from mlxspec.drafter import distill
from mlxspec.drafter.answers import shipped_answers
from mlxspec.drafter.block_train import BlockStudent, build_block, save_block
from mlxspec.drafter.data import DataStore, add_file, add_text, self_distill
from mlxspec.drafter.exit import ExitStudent, build_exit, save_exit
from mlxspec.drafter.head import HeadSpec, build_head, save_head
from mlxspec.drafter.medusa import MedusaHeads, MedusaStudent, save_medusa
from mlxspec.drafter.progress import progress_bar
from mlxspec.drafter.prompts import DEFAULT_PROMPTS, chat_prompts
from mlxspec.drafter.train import (
    TEACHER_TOP,
    HeadStudent,
    Progress,
    Student,
    TrainSettings,
    check_layers,
    choose_vocab,
    coverage,
    train,
)
from mlxspec.models.anatomy import Decoder, split_decoder
from mlxspec.models.loading import LoadedModel
from mlxspec.registry.models_toml import ModelEntry
from mlxspec.registry.register import register_proposer

HELD_OUT = "held-out"
HELD_OUT_PROMPTS = 80  # ~10k answer tokens: enough for the agreement measure (EVAL_POSITIONS)
KINDS = ("head", "model", "exit", "medusa", "block")
PROPOSER_NAMES = {
    "head": "head",
    "model": "distilled",
    "exit": "self-spec-exit",
    "medusa": "medusa",
    "block": "block",
}


@dataclass
class DrafterJob:
    out: Path
    data_dir: Path
    self_distill: bool = True
    prompts: int | None = DEFAULT_PROMPTS  # how many of the built-in prompts (None: all)
    text_tokens: int = 100_000
    extra_text: Path | None = None
    answer_tokens: int = 128
    vocab: int = 8192
    train: TrainSettings = None  # type: ignore[assignment]
    register: bool = True
    proposer_name: str | None = None  # None: PROPOSER_NAMES[kind]
    kind: str = "head"
    # model / exit: how many of the target's layers; head: its own layers (None: default)
    layers: int | None = None
    heads: int = 4  # medusa: how many tokens ahead it guesses


# Per kind, what differs from TrainSettings' defaults (those suit a head).
KIND_SETTINGS: dict[str, dict] = {
    "head": {},
    # Pretrained layers: gentler steps (1e-3 was no better over 30 steps on SmolLM2, and
    # bumpier); a held-out measure costs ~25 s on a 2-core CPU (a full-vocabulary head).
    "model": {"learning_rate": 3e-4, "batch": 4, "eval_every_seconds": 240.0},
    "exit": {"batch": 4, "window": 128},  # each batch runs L target layers first
    "medusa": {},
    "block": {},
}


def train_settings(kind: str, budget_minutes: float, unroll: int | None = None) -> TrainSettings:
    """The kind's settings; `unroll` (heads only) replaces its default."""
    settings = TrainSettings(budget_minutes=budget_minutes, **KIND_SETTINGS[kind])
    if unroll is not None:
        if kind != "head":
            raise ValueError(f"--unroll is for --kind head; --kind {kind} drafts no steps")
        settings.unroll = unroll
    return settings


def make_data(
    entry: ModelEntry, loaded: LoadedModel, decoder: Decoder, job: DrafterJob, say
) -> DataStore:
    """Teacher data into `job.data_dir`; what is already there is kept (resumable)."""
    store = DataStore(job.data_dir, entry.target, decoder.width)
    tokenizer = loaded.tokenizer
    held_out = chat_prompts(held_out=True)[:HELD_OUT_PROMPTS]
    # Answers committed with the package (drafter/answers.py) are not generated again.
    committed = {
        split: shipped_answers(entry.target, tokenizer, split) for split in ("train", "held-out")
    }
    if store.done(HELD_OUT) < len(held_out):
        say(f"held-out answers for measuring acceptance ({len(held_out)} prompts)")
        self_distill(
            loaded.model,
            tokenizer,
            decoder,
            store,
            held_out,
            HELD_OUT,
            job.answer_tokens,
            progress=progress_bar("held-out"),
            answered=committed["held-out"],
        )
    if job.self_distill:
        prompts = chat_prompts()[: job.prompts]
        if store.done("self-distill") < len(prompts):
            say(f"the target answers {len(prompts)} prompts (self-distillation; resumable)")
            self_distill(
                loaded.model,
                tokenizer,
                decoder,
                store,
                prompts,
                "self-distill",
                job.answer_tokens,
                progress=progress_bar("self-distill"),
                answered=committed["train"],
            )
    if job.text_tokens and store.tokens("text") < job.text_tokens:
        say(f"teacher states on up to {job.text_tokens} tokens of offline documentation")
        add_text(decoder, tokenizer, store, job.text_tokens, progress=progress_bar("text"))
    if job.extra_text is not None:
        add_file(
            decoder, tokenizer, store, job.extra_text, progress=progress_bar(job.extra_text.name)
        )
    return store


def make_student(
    entry: ModelEntry, loaded: LoadedModel, decoder: Decoder, job: DrafterJob, vocab: mx.array
) -> Student:
    """A fresh drafter of `job.kind` (bad --layers raise ValueError)."""
    total = len(decoder.layers)
    if job.kind == "head":
        spec = HeadSpec(
            hidden_size=decoder.width,
            vocab_size=decoder.embed.weight.shape[0],
            target=entry.target,
            final_norm=True,
            feed_normed=True,
            layers=job.layers or 1,
        )
        head = build_head(spec, loaded.model, vocab)
        settings = job.train
        return HeadStudent(
            head, decoder, settings.feature_weight, settings.unroll, settings.unroll_from
        )
    if job.kind == "model":
        layers = distill.default_layers(total) if job.layers is None else job.layers
        return distill.ModelStudent(loaded.model, decoder, layers, vocab)
    if job.kind == "exit":
        layers = total // 2 if job.layers is None else job.layers
        return ExitStudent(build_exit(decoder, layers, vocab, entry.target), decoder)
    if job.kind == "medusa":
        heads = MedusaHeads(decoder.width, job.heads, vocab)
        return MedusaStudent(heads, decoder)
    if job.kind == "block":
        return BlockStudent(build_block(decoder, job.layers or 1), decoder, vocab)
    raise ValueError(f"unknown drafter kind {job.kind!r}; choose one of: {', '.join(KINDS)}")


def save_student(student: Student, loaded: LoadedModel, job: DrafterJob, record: dict) -> dict:
    """Save the trained drafter in its kind's format; the proposer options that use it."""
    where = str(job.out.resolve())
    if isinstance(student, HeadStudent):
        student.module.spec.record = record
        save_head(student.module, job.out)
        return {"kind": "head", "path": where}
    if isinstance(student, distill.ModelStudent):
        distill.save_draft_model(student.module, loaded, job.out, record)
        return {"kind": "draft-model", "draft": where}
    if isinstance(student, MedusaStudent):
        save_medusa(student.module, job.out, record)
        return {"kind": "medusa", "path": where}
    if isinstance(student, BlockStudent):
        save_block(student.module, student.decoder, job.out, record)
        return {"kind": "block", "path": where}
    student.module.spec.record = record
    save_exit(student.module, job.out)
    return {"kind": "self-spec", "layers": student.layers, "exit": where}


def train_drafter(entry: ModelEntry, loaded: LoadedModel, job: DrafterJob, say) -> dict:
    """The whole job; returns the training record that is also saved with the drafter."""
    started = time.perf_counter()
    decoder = split_decoder(loaded.model)
    if job.kind == "medusa" and job.layers is not None:  # before making any data
        raise ValueError("--layers is for --kind head, model and exit; --kind medusa has none")
    if job.layers is not None:
        check_layers(job.layers, len(decoder.layers), head=job.kind in ("head", "block"))
    store = make_data(entry, loaded, decoder, job, say)
    training = [s for src in ("self-distill", "text", "file") for s in store.shards(src)]
    answers = store.shards("self-distill") or training
    eval_shards = store.shards(HELD_OUT)
    vocab_size = decoder.embed.weight.shape[0]
    vocab = choose_vocab(answers, job.vocab, vocab_size, set(loaded.tokenizer.eos_token_ids))
    student = make_student(entry, loaded, decoder, job, vocab)
    if (job.out / student.checkpoint).is_dir():
        say(f"resuming from {job.out / student.checkpoint}")
    positions = sum(len(s.tokens) for s in training)
    say(f"the teacher's top {TEACHER_TOP} tokens at {positions:,} positions (once per run)")
    bar = tqdm(total=round(job.train.budget_minutes * 60), desc="training", unit="s")

    def report(progress: Progress, metrics: dict | None) -> None:
        bar.n = min(bar.total, round(progress.seconds))
        if metrics:
            bar.set_postfix(
                loss=metrics.get("loss", "-"),
                accept=metrics["first_token_acceptance"],
                refresh=False,
            )
        bar.refresh()

    progress = train(student, training, eval_shards, job.out, job.train, report)
    bar.close()
    record = {
        "kind": job.kind,
        "target": entry.target,
        "model": entry.name,
        "trained_on": device.describe(),
        "data": {
            "self_distill_tokens": store.tokens("self-distill"),
            "text_tokens": store.tokens("text"),
            "file_tokens": store.tokens("file"),
            "held_out_tokens": store.tokens(HELD_OUT),
        },
        "draft_vocab": int(vocab.size),
        "vocab_coverage_held_out": round(coverage(eval_shards, vocab), 4),
        "settings": asdict(job.train),
        "steps": progress.step,
        "train_seconds": round(progress.seconds, 1),
        "positions_seen": progress.positions,
        "curve": progress.curve,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    if isinstance(student, HeadStudent):  # what drafting k tokens can expect
        record["acceptance_by_position"] = student.by_position(eval_shards)
    if job.kind == "medusa":
        record["heads"] = job.heads
    elif job.kind != "head":
        record["layers"] = student.layers
        record["target_layers"] = len(decoder.layers)
    if isinstance(student, ExitStudent):
        record["layer_skip_acceptance"] = student.layer_skip_acceptance
    options = save_student(student, loaded, job, record)
    mx.eval(student.module.parameters())
    if job.register:
        name = job.proposer_name or PROPOSER_NAMES[job.kind]
        when = time.strftime("%Y-%m-%d %H:%M")
        note = f"added by mlxspec train-drafter --kind {job.kind} on {when}"
        path = register_proposer(entry.name, name, options, note)
        say(f"registered as proposer '{name}' of '{entry.name}' in {path}")
    return record
