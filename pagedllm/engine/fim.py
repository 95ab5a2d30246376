"""Fill-in-the-middle (FIM) prompts: the prefix-suffix-middle token layout code models are
trained on, built from the tokenizer's own FIM tokens.

``fim_tokens(tokenizer)`` finds the FIM token family a tokenizer has (None when it has none:
such a model was not trained to infill, and a ``suffix`` is refused with a 400), and
``encode_fim`` builds the prompt ids:

    [special prefix tokens] [extra context] <PRE> prefix <SUF> suffix <MID> middle

(PSM order, llama.cpp's ``/infill`` layout; the special prefix is what the tokenizer adds to a
text, e.g. CodeLlama's BOS). ``extra`` (llama.cpp's ``input_extra``, a list of
``{"filename", "text"}``) uses the repository-level layout when the family has repo/file
tokens (Qwen2.5-Coder, StarCoder2):

    <REPO>myproject\\n <SEP>filename\\ntext ... <SEP>filename\\n <PRE> ...

and the chunks' texts alone before ``<PRE>`` otherwise. Families, by token text:

* Qwen2.5-Coder: ``<|fim_prefix|> <|fim_suffix|> <|fim_middle|>`` (+ ``<|repo_name|> <|file_sep|>``)
* StarCoder / StarCoder2: ``<fim_prefix> <fim_suffix> <fim_middle>`` (+ ``<repo_name> <file_sep>``)
* CodeLlama: ``▁<PRE> ▁<SUF> ▁<MID>``
* DeepSeek-Coder: ``<｜fim▁begin｜> <｜fim▁hole｜> <｜fim▁end｜>``
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

# (name, prefix, suffix, middle, repo, file separator)
FIM_FAMILIES: tuple[tuple[str, str, str, str, Optional[str], Optional[str]], ...] = (
    ("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    ("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", None, None),
    ("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),
)


@dataclass(frozen=True)
class FIMTokens:
    """The FIM token ids of one tokenizer.

    Attributes:
        family: "qwen", "starcoder", "codellama" or "deepseek".
        prefix, suffix, middle: the ``<PRE>``, ``<SUF>``, ``<MID>`` token ids.
        repo, file_sep: the repository-name and file-separator ids (None when the family has none).
    """

    family: str
    prefix: int
    suffix: int
    middle: int
    repo: Optional[int] = None
    file_sep: Optional[int] = None


_CACHE_ATTR = "_pagedllm_fim_tokens"


def fim_tokens(tokenizer: Any) -> Optional[FIMTokens]:
    """The tokenizer's FIM tokens (the first family of ``FIM_FAMILIES`` whose prefix, suffix and
    middle tokens are all in its vocabulary, added tokens included), or None. Cached on the
    tokenizer object."""
    if hasattr(tokenizer, _CACHE_ATTR):
        cached: Optional[FIMTokens] = getattr(tokenizer, _CACHE_ATTR)
        return cached
    vocab = tokenizer.get_vocab()
    found = None
    for name, pre, suf, mid, repo, sep in FIM_FAMILIES:
        if pre in vocab and suf in vocab and mid in vocab:
            found = FIMTokens(name, vocab[pre], vocab[suf], vocab[mid],
                              vocab.get(repo) if repo else None, vocab.get(sep) if sep else None)
            break
    try:
        setattr(tokenizer, _CACHE_ATTR, found)
    except AttributeError:  # pragma: no cover - a tokenizer that refuses attributes
        pass
    return found


def _special_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text with ``add_special_tokens`` (e.g. BOS)."""
    with_sp = list(tokenizer.encode("a", add_special_tokens=True))
    without = list(tokenizer.encode("a", add_special_tokens=False))
    for i in range(len(with_sp) - len(without) + 1):
        if with_sp[i:i + len(without)] == without:
            return with_sp[:i]
    return []


def encode_fim(tokenizer: Any, prefix: str, suffix: str, *, middle: str = "",
               extra: Optional[Sequence[dict[str, Any]]] = None, add_special_tokens: bool = True,
               tokens: Optional[FIMTokens] = None) -> list[int]:
    """The token ids of a FIM prompt (layout in the module docstring).

    Args:
        tokenizer: a transformers tokenizer with FIM tokens.
        prefix: the text before the gap (OpenAI's ``prompt``, llama.cpp's ``input_prefix``).
        suffix: the text after the gap (``suffix`` / ``input_suffix``).
        middle: text already written in the gap (llama.cpp's ``prompt``, after ``<MID>``).
        extra: context chunks ``[{"filename": str, "text": str}]`` (llama.cpp's ``input_extra``).
        add_special_tokens: put the tokenizer's special prefix (BOS) first.
        tokens: the FIM ids (default: ``fim_tokens(tokenizer)``).

    Raises:
        ValueError: the tokenizer has no FIM tokens; an ``extra`` chunk that is not a dict of strings.
    """
    t = tokens or fim_tokens(tokenizer)
    if t is None:
        raise ValueError("the tokenizer has no fill-in-the-middle tokens")

    def enc(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_special_tokens=False)) if s else []

    ids = _special_prefix(tokenizer) if add_special_tokens else []
    if extra:
        for chunk in extra:
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                    or not isinstance(chunk.get("filename", ""), str):
                raise ValueError("input_extra: each chunk must be {\"filename\": string, \"text\": string}")
        if t.repo is not None and t.file_sep is not None:
            ids += [t.repo] + enc("myproject\n")
            for chunk in extra:
                ids += [t.file_sep] + enc(f"{chunk.get('filename', '')}\n{chunk.get('text', '')}")
            ids += [t.file_sep] + enc("filename\n")
        else:
            for chunk in extra:
                ids += enc(chunk.get("text", ""))
    ids += [t.prefix] + enc(prefix) + [t.suffix] + enc(suffix) + [t.middle] + enc(middle)
    return ids
