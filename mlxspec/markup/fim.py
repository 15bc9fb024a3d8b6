"""Fill-in-the-middle: a request for the code at the cursor (`Infill`: the text before and
after it, other files as context) rendered with the model's own FIM tokens into the token
ids the engine takes, so that the loop, the proposers, the batch and the prompt cache need
no FIM branch: prompt lookup reads the suffix and the extra files because they are prompt.

The layout is found from the model's tokens, as llama.cpp's llama-vocab.cpp finds them: a
GGUF file's `tokenizer.ggml.fim_*_token_id` keys first, else the tokens by their text.
Extra files are laid out the repo-level way where the model has the tokens for it (Qwen2.5-
Coder's `<|repo_name|>`, then `<|file_sep|>name\\ntext` per file, arXiv 2409.12186), else
joined with llama.cpp's snippet separator; the token budget is llama.cpp's
`format_prompt_infill` (tools/server/server-common.cpp): prefix 3/4 and suffix 1/4 of a
batch, extra files what the context leaves, the newest kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxspec.settings import GenerationError

# The token texts of each family's FIM tokens: (prefix, suffix, middle, pad, repo, file_sep).
# Names are what models.toml's `fim` setting takes; `suffix_first` families are trained
# suffix-prefix-middle (Codestral has no middle token: the prefix runs up to the cursor).
FAMILIES: dict[str, tuple[str | None, ...]] = {
    "qwen": (
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ),
    "starcoder": (
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        "<fim_pad>",
        "<repo_name>",
        "<file_sep>",
    ),
    "santacoder": ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", "<fim-pad>", None, None),
    "deepseek": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None, None),
    "codellama-bare": ("<PRE>", "<SUF>", "<MID>", "<PAD>", None, None),
    "codegemma": (
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        None,
        None,
        "<|file_separator|>",
    ),
    "codestral": ("[PREFIX]", "[SUFFIX]", None, None, None, None),
    "glm": ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>", None, None, None),
}
SUFFIX_FIRST = {"codestral"}
# GGUF metadata keys, in the order of a FAMILIES row.
GGUF_KEYS = ("fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
# Text that ends generation wherever a FIM model writes it (llama.cpp's end-of-generation
# tokens by text): a base coder model ends its middle with its end-of-text token.
END_TEXTS = ("<|endoftext|>", "<|end_of_text|>", "<EOT>", "▁<EOT>", "<|file_separator|>")
# llama.cpp's separator between extra chunks for a model without a file separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
REPO_NAME = "myproject"  # llama.cpp's placeholder: editors send no project name
ORDERS = ("psm", "spm")


class FimError(GenerationError):
    """A model or a setting that cannot lay out a fill-in-the-middle prompt (one line)."""


@dataclass(frozen=True)
class ExtraFile:
    """Context an editor sends beside the file being edited (llama.vim's ring buffer of
    chunks, Continue's snippets): a file name and some of its text."""

    filename: str
    text: str


@dataclass(frozen=True)
class Infill:
    """A fill-in-the-middle request: the code before the cursor (`prefix`), after it
    (`suffix`), other files (`extra`), and `prompt`, text appended to the prefix (llama.cpp's
    `/infill` field: what the user already typed on the line)."""

    prefix: str
    suffix: str
    extra: tuple[ExtraFile, ...] = ()
    prompt: str = ""


@dataclass(frozen=True)
class FimLayout:
    """A model's FIM tokens (ids; None where it has no such token) and their order."""

    family: str
    prefix: int
    suffix: int
    middle: int | None
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None
    suffix_first: bool = False
    end_of_text: tuple[int, ...] = ()

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Tokens that end a completion: the pad, repo and file separators (a model that
        writes one has finished the hole and begun another document) and end-of-text."""
        ids = (self.pad, self.repo, self.file_sep, *self.end_of_text)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def order(self) -> str:
        return "spm" if self.suffix_first else "psm"


def find_layout(tokenizer, setting: str = "auto", order: str = "auto") -> FimLayout | None:
    """The model's FIM layout (None: it has no FIM tokens). `setting` (models.toml `fim`):
    "auto" finds the family from the tokens, "none" turns FIM off, a family name insists on
    that family's tokens (FimError where the vocabulary lacks them); `order`: "auto" (the
    family's), "psm" or "spm" (suffix first: only the prefix's tail changes per keystroke)."""
    if setting == "none":
        return None
    if setting != "auto" and setting not in FAMILIES:
        raise FimError(f"fim: unknown layout {setting!r}; choose auto, none, {', '.join(FAMILIES)}")
    if order not in ("auto", *ORDERS):
        raise FimError(f"fim_order: unknown order {order!r}; choose auto, psm or spm")
    vocab = tokenizer.get_vocab()
    layout = None
    if setting == "auto":
        layout = _from_gguf(tokenizer, vocab)
    if layout is None:
        names = FAMILIES if setting == "auto" else [setting]
        layout = next((found for n in names if (found := _from_texts(n, vocab))), None)
    if layout is None:
        if setting != "auto":
            wanted = ", ".join(t for t in FAMILIES[setting][:3] if t)
            raise FimError(f"fim: this model has no {setting} tokens ({wanted})")
        return None
    if order != "auto":
        layout = _with_order(layout, order == "spm")
    return layout


def _from_texts(family: str, vocab: dict[str, int]) -> FimLayout | None:
    texts = FAMILIES[family]
    ids = [None if text is None else vocab.get(text) for text in texts]
    needed = ids[:2] if family in SUFFIX_FIRST else ids[:3]
    if any(token_id is None for token_id in needed):
        return None
    return FimLayout(
        family,
        *ids,
        suffix_first=family in SUFFIX_FIRST,
        end_of_text=_end_of_text(vocab),
    )


def _from_gguf(tokenizer, vocab: dict[str, int]) -> FimLayout | None:
    """From a GGUF file's metadata ids (kept on the tokenizer by models/gguf_tokenizer.py)."""
    ids = getattr(tokenizer, "gguf_fim_token_ids", None) or {}
    if not all(ids.get(key) is not None for key in GGUF_KEYS[:3]):
        return None
    prefix_text = tokenizer.convert_ids_to_tokens(ids["fim_pre"])
    family = next((n for n, texts in FAMILIES.items() if texts[0] == prefix_text), "gguf")
    return FimLayout(
        family,
        *(ids.get(key) for key in GGUF_KEYS),
        suffix_first=family in SUFFIX_FIRST,
        end_of_text=_end_of_text(vocab),
    )


def _end_of_text(vocab: dict[str, int]) -> tuple[int, ...]:
    return tuple(vocab[text] for text in END_TEXTS if text in vocab)


def _with_order(layout: FimLayout, suffix_first: bool) -> FimLayout:
    if suffix_first and layout.family in SUFFIX_FIRST:
        return layout
    if not suffix_first and layout.middle is None:
        raise FimError(f"fim_order: {layout.family} is trained suffix first only (spm)")
    return FimLayout(**{**layout.__dict__, "suffix_first": suffix_first})


@dataclass(frozen=True)
class InfillBudget:
    """How many tokens each part may take (llama.cpp's split): `batch` tokens for prefix
    (3/4) and suffix (1/4); extra files get what the context leaves after the batch and
    twice the answer's room."""

    context: int
    max_tokens: int
    batch: int = 2048

    def prefix(self) -> int:
        return 3 * (self.batch // 4)

    def suffix(self, prompt_tokens: int) -> int:
        return max(0, self.batch // 4 - (2 + prompt_tokens))

    def extra(self) -> int:
        return max(0, self.context - self.batch - 2 * self.max_tokens)


def encode_infill(tokenizer, layout: FimLayout, infill: Infill, budget: InfillBudget) -> list[int]:
    """The prompt's token ids: [BOS] [extra files] then prefix-suffix-middle
    (`FIM_PRE prefix prompt FIM_SUF suffix FIM_MID`), or suffix first for an SPM layout
    (`FIM_SUF suffix FIM_PRE prefix prompt [FIM_MID]`). The prefix keeps its end, the
    suffix its start, the extra files their newest tokens, each within `budget`."""
    prompt = _text_ids(tokenizer, infill.prompt)
    prefix = _text_ids(tokenizer, infill.prefix)[-budget.prefix() :] if budget.prefix() else []
    suffix = _text_ids(tokenizer, infill.suffix)[: budget.suffix(len(prompt))]
    extra = _extra_ids(tokenizer, layout, infill.extra)
    extra = extra[len(extra) - min(len(extra), budget.extra()) :]
    head = [layout.prefix, *prefix, *prompt]
    tail = [layout.suffix, *suffix]
    ids = [*_leading_special(tokenizer), *extra]
    ids += [*tail, *head] if layout.suffix_first else [*head, *tail]
    if layout.middle is not None:
        ids.append(layout.middle)
    return ids


def _extra_ids(tokenizer, layout: FimLayout, extra: tuple[ExtraFile, ...]) -> list[int]:
    """The extra files as the model was trained to read other files of its repository, or
    as llama.cpp joins them for a model without those tokens. A model with a file separator
    also gets the file being edited named (llama.cpp's placeholder name) before the hole."""
    ids: list[int] = []
    if layout.repo is not None:
        ids += [layout.repo, *_text_ids(tokenizer, f"{REPO_NAME}\n")]
    for chunk in extra:
        if layout.file_sep is not None:
            ids += [layout.file_sep, *_text_ids(tokenizer, f"{chunk.filename or 'tmp'}\n")]
        else:
            ids += _text_ids(tokenizer, SNIPPET_SEPARATOR)
        ids += _text_ids(tokenizer, chunk.text)
    if layout.file_sep is not None:
        ids += [layout.file_sep, *_text_ids(tokenizer, "filename\n")]
    return ids


def _text_ids(tokenizer, text: str) -> list[int]:
    """Text as tokens, with no special tokens added and none parsed from it: code that
    contains `<|fim_prefix|>` is text, not a marker (llama.cpp: parse_special = false)."""
    if not text:
        return []
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer that takes no such argument
        return list(tokenizer.encode(text, add_special_tokens=False))


def _leading_special(tokenizer) -> list[int]:
    """What the tokenizer puts before any text by default (its BOS, where it adds one)."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a"))
    return full[: len(full) - len(plain)] if full[len(full) - len(plain) :] == plain else []
