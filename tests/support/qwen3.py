"""An offline stand-in for TRL's Qwen3 test checkpoints (`trl-internal-testing/tiny-Qwen3MoeForCausalLM` and the
`tiny-Qwen2ForSequenceClassification-2.5` reward model): tiny random models with Qwen3's vocabulary size and a
tokenizer that gives the token ids TRL's tool tests hard-code their meaning.

The tokenizer is byte-level, like Qwen3's, and shares its layout where it matters:

- ids 0-255 are the 256 byte symbols in GPT-2's `bytes_to_unicode` order, which is Qwen3's (`!` is 0, `,` 11, `3` 18,
  `I` 40, `a` 64, the newline 198, the space 220);
- the multi-character pieces TRL's fake completions use sit at their Qwen3 ids (`QWEN3_PIECES`: 606 `name`, 64648
  `multiply`, 11248 `}}\\n`, ...); an id below 151643 that is neither these nor a learned merge (below) decodes to a
  placeholder (`<|unused_ID|>`);
- Qwen3's 26 added tokens sit at Qwen3's ids 151643-151668 (`<|endoftext|>` pad, `<|im_end|>` EOS, `<tool_call>` ...),
  special or not as in Qwen3 (`<tool_call>`, `<tool_response>`, `<think>` are not: decoding with
  `skip_special_tokens=True` keeps them).

Encoding pre-tokenizes with Qwen's pattern and applies BPE merges learned, at build time, from what a tool-calling run
renders (the chat template's words, a tool's JSON schema, tool calls and errors, the Zen of Python), so a prompt takes
about as many tokens as with Qwen3 (a prompt with one tool's schema: ~260, where one token per byte would be ~760 and
be cut at `max_prompt_length`). A learned token that is one of the pieces above takes its Qwen3 id (the tool call of
TRL's test encodes to exactly the ids TRL's fake completion hard-codes); the others take ids from 120000 up, which
decode to their text (in Qwen3 those ids are other tokens; nothing here depends on them). The chat template is
Qwen3's own, read from the installed TRL (`trl/chat_templates/qwen3.jinja`, the text TRL compares a tokenizer's
template with to recognise Qwen3); the reward model's is Qwen2.5's (`qwen2_5.jinja`). Nothing is downloaded.

`build_qwen3_standin(path)` writes `path/policy` and `path/reward`, and reuses them when the marker
(`standin_spec.json`) says they were built from the same spec, like `grpo_async.testing.build_tiny_model`.
"""

from __future__ import annotations

import json
import os

#: Qwen3's added tokens: id -> (content, special)
QWEN3_ADDED = {
    151643: ("<|endoftext|>", True),
    151644: ("<|im_start|>", True),
    151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
}

#: multi-character Qwen3 tokens the ported tests generate: id -> the text it decodes to
QWEN3_PIECES = {
    4913: '{"',
    606: "name",
    788: '":',
    330: ' "',
    64648: "multiply",
    22785: "_tool",
    497: '",',
    16370: "arguments",
    5212: ' {"',
    11248: "}}\n",
    17453: "Done",
    1513: " don",
    944: "'t",
    1414: " know",
    894: " any",
    5392: " tool",
}

QWEN3_TOKENIZER_SIZE = 151669  # len(tokenizer) of Qwen3
QWEN3_VOCAB_SIZE = 151936  # the model's embedding rows (Qwen3 pads the vocabulary)
PAD, EOS = "<|endoftext|>", "<|im_end|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> symbol table (printable bytes map to themselves, the others to U+0100 onwards)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _trl_chat_template(name: str) -> str:
    """A chat template file of the installed TRL, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Qwen3 stand-in reads Qwen3's chat template from the installed trl (test extra)")
    with open(os.path.join(list(spec.submodule_search_locations)[0], "chat_templates", name)) as f:
        return f.read()


#: Qwen2/Qwen3's pre-tokenization pattern (digits one by one, punctuation with its trailing newlines: `}}\n`)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _merge_corpus(chat_template: str) -> list[str]:
    """Text the stand-in learns its merges from: what a tool-calling run renders (the chat template's own words, a
    tool's JSON schema, tool calls and errors) and the Zen of Python."""
    import json

    from transformers.utils import get_json_schema

    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    call = {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    errors = [
        "multiply() got an unexpected keyword argument 'c'",
        "multiply() missing 2 required positional arguments: 'a' and 'b'",
        "Tool multiply not found.",
    ]
    texts = [chat_template, json.dumps(get_json_schema(multiply)), json.dumps(call), str({"error": errors[0]})]
    replies = ["I don't know any tool", "Done!"] * 2  # the fake completions' plain text (a merge needs 2 sightings)
    return texts + errors + replies + zen_lines()


def _learned_merges(corpus: list[str], taken: dict[str, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE merges learned from `corpus` (byte-level, `tokenizers`' trainer) and the ids of the tokens they make: a
    token that is one of Qwen3's pieces (`taken`: byte-level string -> id) keeps its Qwen3 id, the others get ids
    from 120000 up (decoding them gives their text; they stand for whatever Qwen3 has there)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = _pre_tokenizer()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=2000, min_frequency=2, initial_alphabet=alphabet, show_progress=False)
    learner.train_from_iterator(corpus, trainer)
    model = json.loads(learner.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    ids, next_id = {}, 120000
    for token, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            ids[token] = taken.get(token, next_id)
            next_id += token not in taken
    return ids, merges


def build_qwen3_tokenizer(chat_template: str = "qwen3.jinja"):
    """The byte-level stand-in tokenizer (see the module docstring) with one of TRL's chat templates."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    template = _trl_chat_template(chat_template)
    symbols = bytes_to_unicode()  # in GPT-2's order (the printable bytes first): Qwen3's ids 0-255
    by_id = dict(enumerate(symbols.values()))
    pieces = {"".join(symbols[b] for b in text.encode()): i for i, text in QWEN3_PIECES.items()}
    learned, merges = _learned_merges(_merge_corpus(template), pieces)
    by_id.update({i: token for token, i in {**pieces, **learned}.items()})
    first_added = min(QWEN3_ADDED)
    vocab = {by_id.get(i, f"<|unused_{i}|>"): i for i in range(first_added)}
    if len(vocab) != first_added:
        raise AssertionError("stand-in vocabulary: two ids share a token")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    for i in sorted(QWEN3_ADDED):  # in id order: each lands at the next id, Qwen3's
        content, special = QWEN3_ADDED[i]
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        if tok.token_to_id(content) != i:
            raise AssertionError(f"{content} landed at {tok.token_to_id(content)}, not Qwen3's {i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        chat_template=template,
        model_max_length=40960,
        clean_up_tokenization_spaces=False,
    )


STANDIN_SPEC = {
    "policy": {"hidden_size": 16, "layers": 2, "heads": 2, "kv_heads": 1, "experts": 4, "top_k": 2, "expert": 16},
    "reward": {"hidden_size": 16, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 32},
    "vocab_size": QWEN3_VOCAB_SIZE,
    "seed": 0,
    "version": 2,
}


def build_qwen3_standin(path: str | os.PathLike) -> dict[str, str]:
    """Write the stand-in policy (a tiny `Qwen3MoeForCausalLM`, Qwen3's generation config ids) and reward model (a
    tiny `Qwen2ForSequenceClassification`, one label) with their tokenizers under `path`; returns
    `{"policy": folder, "reward": folder}`. Idempotent for the same `STANDIN_SPEC`."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2Config,
        Qwen2ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    path = os.fspath(path)
    out = {"policy": os.path.join(path, "policy"), "reward": os.path.join(path, "reward")}
    marker = os.path.join(path, "standin_spec.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == STANDIN_SPEC:
                return out
    tokenizer = build_qwen3_tokenizer()
    pad, eos = tokenizer.convert_tokens_to_ids([PAD, EOS])
    p = STANDIN_SPEC["policy"]
    torch.manual_seed(STANDIN_SPEC["seed"])
    policy = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=QWEN3_VOCAB_SIZE,
            hidden_size=p["hidden_size"],
            intermediate_size=2 * p["expert"],
            moe_intermediate_size=p["expert"],
            num_hidden_layers=p["layers"],
            num_attention_heads=p["heads"],
            num_key_value_heads=p["kv_heads"],
            head_dim=p["hidden_size"] // p["heads"],
            num_experts=p["experts"],
            num_experts_per_tok=p["top_k"],
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            bos_token_id=pad,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    )
    policy.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    policy.save_pretrained(out["policy"])
    tokenizer.save_pretrained(out["policy"])
    r = STANDIN_SPEC["reward"]
    reward = Qwen2ForSequenceClassification(
        Qwen2Config(
            vocab_size=QWEN3_VOCAB_SIZE,
            hidden_size=r["hidden_size"],
            intermediate_size=r["intermediate"],
            num_hidden_layers=r["layers"],
            num_attention_heads=r["heads"],
            num_key_value_heads=r["kv_heads"],
            num_labels=1,
            pad_token_id=pad,
            eos_token_id=pad,
        )
    )
    reward.save_pretrained(out["reward"])
    build_qwen3_tokenizer("qwen2_5.jinja").save_pretrained(out["reward"])
    with open(marker, "w") as f:
        json.dump(STANDIN_SPEC, f)
    return out


def zen_lines() -> list[str]:
    """The Zen of Python, one aphorism a line (Python's own `this` module)."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line]


def zen_prompts(n: int | None = None):
    """A stand-in for TRL's `trl-internal-testing/zen` (`conversational_prompt_only`): the first `n` aphorisms of the
    Zen of Python as chat prompts, each without its last word (`"Beautiful is better than"`)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": z.rsplit(" ", 1)[0]}] for z in zen_lines()[:n]]})
