"""Text tokenizer and prompt templates of the Qwen3-TTS talker.

Scope: turning text into the token ids the talker embeds. The Qwen2 byte-level BPE is rebuilt from
the released `vocab.json`, `merges.txt` and `tokenizer_config.json` with the `tokenizers` library
(the checkpoints ship no `tokenizer.json`), and the three prompt templates of the reference
(target text, voice-clone reference text, instruction) are built as id lists.

Non-goals: chat templates, batching and padding, tensors (ids are plain lists; the model code turns
them into tensors), and any dependency on `transformers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from tokenizers import AddedToken, Encoding, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .config import CheckpointError, read_json

ROLE_IDS = 3  # <|im_start|> assistant \n: the ids before a target text in its template
CLOSING_IDS = 5  # <|im_end|> \n <|im_start|> assistant \n: the ids after it

# The split regex of Qwen2TokenizerFast: English contractions, letter runs with one optional
# leading non-letter, single digits, punctuation runs, then whitespace.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The regex transformers 4.57.3 swaps in when `fix_mistral_regex=True` and the tokenizer is loaded
# from a local directory whose config.json names a transformers version in (4.57.2, 5.0): the
# reference `qwen-tts` loads its processor that way. It splits words at lower->upper case changes
# ("iPhone" -> "i" + "Phone"), keeps combining marks inside words (Thai splits differently), has no
# contraction rule, and lets a punctuation run that ends in newlines take a following "/" along.
REFERENCE_LOCAL_SPLIT_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPLIT_REGEXES: Mapping[str, str] = MappingProxyType(
    {"qwen2": QWEN2_SPLIT_REGEX, "reference-local": REFERENCE_LOCAL_SPLIT_REGEX}
)

VOCAB_FILE, MERGES_FILE, CONFIG_FILE = "vocab.json", "merges.txt", "tokenizer_config.json"


class TextTokenizer:
    """Qwen2 byte-level BPE plus the Qwen3-TTS prompt templates.

    The reference tokenizes each whole template string. Its special tokens cut that string into
    segments that are tokenized independently, so the text's last token never merges with what
    follows; its first token can merge with the role's "\\n" only through the whitespace rule
    `\\s*[\\r\\n]+` of the split regex, i.e. when the text's leading run of whitespace contains
    "\\r" or "\\n". Then the role's "\\n" and that run form one pre-token, which BPE usually turns
    into other ids ("\\n" + "\\n\\nx" gives "\\n\\n\\n" + "x", not "\\n" + "\\n\\n" + "x"), and
    the reference's fixed slices `[3:-5]` (target) and `[3:-2]` (reference text) cut a wrong span.

    A text is plain text, never markup: "<|im_end|>" written in it is spoken as those characters,
    never taken for the control token of that name (the reference takes it for one, so a text could
    end its own turn and write the prompt that follows). Texts are therefore tokenized by a second
    tokenizer without the added tokens (`text_ids`); `encode` keeps them for the templates. For a
    text that holds no added token's name the two give the same ids.

    `assistant_ids` and `ref_ids` are therefore built as role prefix + `text_ids(text)` + suffix: the
    target prompt always starts with [<|im_start|>, "assistant", "\\n"] (3 ids), ends with
    [<|im_end|>, "\\n", <|im_start|>, "assistant", "\\n"] (5 ids), and `[3:-5]` is exactly
    `text_ids(text)`. For any text whose leading whitespace holds no "\\r" or "\\n" (in particular
    any text not starting with a newline) and that holds no added token's name, these ids equal the
    reference's, given the same split regex. `instruct_ids` is used whole, never sliced: the user
    role's "user\\n" and the instruction are one piece, as in the reference's template string, so
    its ids equal the reference's for every instruction without an added token's name.

    Encoding is read-only on the underlying `tokenizers.Tokenizer`, so one instance can be shared by
    threads; the fixed prefixes and suffixes are computed once.
    """

    def __init__(self, tokenizer: Tokenizer, plain: Tokenizer):
        self._tokenizer = tokenizer  # with the added tokens: the templates
        self._plain = plain  # without them: the texts
        im_start, im_end = self._special_id("<|im_start|>"), self._special_id("<|im_end|>")
        newline = tuple(self.encode("\n"))
        assistant = (im_start, *self.encode("assistant"), *newline)
        self._assistant_prefix = assistant  # [151644, 77091, 198]
        self._turn_end = (im_end, *newline)  # [151645, 198]
        self._assistant_suffix = self._turn_end + assistant  # [151645, 198, 151644, 77091, 198]
        if (len(self._assistant_prefix), len(self._assistant_suffix)) != (ROLE_IDS, CLOSING_IDS):
            raise CheckpointError("the tokenizer does not encode the chat template's role and turn ids as Qwen's does")

    @classmethod
    def from_dir(cls, path: str | Path, *, regex: str = "qwen2") -> TextTokenizer:
        """Load the tokenizer files at the root of a checkpoint directory.

        `regex` picks the pre-tokenizer split: "qwen2" (the standard Qwen2 one) or
        "reference-local" (what the reference ends up with when loading a local directory).
        """
        if regex not in SPLIT_REGEXES:
            raise ValueError(f"unknown regex {regex!r}; choose one of {', '.join(SPLIT_REGEXES)}")
        root = Path(path)
        vocab, merges = root / VOCAB_FILE, root / MERGES_FILE
        for file in (vocab, merges):
            if not file.is_file():
                raise CheckpointError(f"missing file: {file}")
        added = read_json(root / CONFIG_FILE).get("added_tokens_decoder")
        if not isinstance(added, dict):
            raise CheckpointError(f"{root / CONFIG_FILE}: missing key 'added_tokens_decoder'")
        try:
            model = BPE.from_file(str(vocab), str(merges))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            raise CheckpointError(f"cannot read {vocab} / {merges}: {e}") from None
        tokenizer = _pipeline(model, regex)
        _add_tokens(tokenizer, added.items(), root / CONFIG_FILE)
        return cls(tokenizer, _pipeline(model, regex))

    def encode(self, text: str) -> list[int]:
        """Token ids of a template string; added tokens such as "<|im_end|>" written in it are
        recognised (a text to speak goes through `text_ids`, which never recognises them)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encoding(self, text: str) -> Encoding:
        """The library's encoding of a text (as `text_ids`): ids plus `word_ids`, the pre-token
        each id comes from (what live text input needs to tell finished words from a word still
        being typed; with no added tokens, no token spans two pre-tokens)."""
        return self._plain.encode(text, add_special_tokens=False)

    def at_least(self, text: str) -> int:
        """The fewest text tokens that `text` followed by anything encodes to: its tokens but those of
        its last pre-token (a word still being typed may yet merge into fewer), plus one for it."""
        encoding = self.encoding(text)
        if not encoding.ids:
            return 0
        last = encoding.word_ids[-1]
        return sum(1 for w in encoding.word_ids if w != last) + 1

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included (for logs and debugging)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def text_ids(self, text: str) -> list[int]:
        """The text tokens the talker reads, `assistant_ids(text)[3:-5]`: plain text, an added
        token's name spelled out like any other characters."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def assistant_ids(self, text: str) -> list[int]:
        """`<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` (target text)."""
        return self.wrap_assistant(self.text_ids(text))

    def wrap_assistant(self, text_ids: list[int]) -> list[int]:
        """The target-text template around already tokenized text."""
        return [*self._assistant_prefix, *text_ids, *self._assistant_suffix]

    def ref_ids(self, ref_text: str) -> list[int]:
        """`<|im_start|>assistant\\n{ref_text}<|im_end|>\\n` (voice-clone reference transcript)."""
        return [*self._assistant_prefix, *self.text_ids(ref_text), *self._turn_end]

    def instruct_ids(self, instruct: str) -> list[int]:
        """`<|im_start|>user\\n{instruct}<|im_end|>\\n` (style or voice-design instruction)."""
        return [self._assistant_prefix[0], *self.text_ids(f"user\n{instruct}"), *self._turn_end]

    def _special_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{CONFIG_FILE}: added token {token!r} is missing")
        return token_id


def _pipeline(model: BPE, regex: str) -> Tokenizer:
    """`model` behind the same pipeline as transformers' Qwen2 slow->fast conversion (offsets
    aside), without added tokens."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEXES[regex]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_tokens(tokenizer: Tokenizer, entries: Iterable[tuple[str, object]], where: Path) -> None:
    """Register `added_tokens_decoder` entries in id order and check each lands on its id."""
    try:
        parsed = sorted(((int(key), spec) for key, spec in entries), key=lambda item: item[0])
    except ValueError:
        raise CheckpointError(f"{where}: added_tokens_decoder has a non-integer id") from None
    for token_id, spec in parsed:
        if not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
            raise CheckpointError(f"{where}: added token {token_id} has no 'content'")
        token = AddedToken(
            spec["content"],
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", False)),
            special=bool(spec.get("special", False)),
        )
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(token.content) != token_id:
            raise CheckpointError(
                f"{where}: added token {token.content!r} should have id {token_id}, "
                f"got {tokenizer.token_to_id(token.content)}"
            )
