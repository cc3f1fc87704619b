"""Make the tiny model's tokenizer (kvrepro/data/models/qwen3-next-tiny/tokenizer*.json).

Why: vLLM's own server, `vllm bench serve` and the OpenAI clients speak text; the GPU-free
engine's model has no weights but needs a tokenizer that vLLM and transformers load like any
other. A byte-level BPE never meets an unknown character, so text from any load tool maps to
ids below the config's ``vocab_size`` (1024) and every id decodes to something.

Run once in the runtime env (it has ``tokenizers``); the output is committed, so kvrepro does
not run this at setup. The corpus is Python's own standard-library sources: deterministic for a
given Python, and plain English prose plus code, like the prompts load tools produce.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 1024
EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
OUT = Path(__file__).resolve().parent.parent / "kvrepro" / "data" / "models" / "qwen3-next-tiny"


def corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        yield path.read_text(errors="replace")


def main() -> int:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE, tokenizer.get_vocab_size()
    tokenizer.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        # plain "role: content" lines, so chat clients work (the model has no chat format to honour)
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    print(f"wrote {OUT}/tokenizer.json ({tokenizer.get_vocab_size()} tokens)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
