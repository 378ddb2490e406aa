"""Chat templates whose assistant turns are wrapped in `{% generation %}...{% endgeneration %}`.

TRL computes the loss on assistant tokens only (`assistant_only_loss=True`) from the mask that
`apply_chat_template(..., return_assistant_tokens_mask=True)` derives from those markers. Many stock
templates have none (SmolLM2's, for one), and TRL 1.12 only patches the families it knows
(`trl.chat_template_utils.get_training_chat_template`: Qwen, Llama 3, Gemma, Phi-3, ...). For the
others we keep marked copies here; a copy is used only after it renders the training conversations
byte-identical to the original, so training sees exactly the text the model sees at inference.
"""
from __future__ import annotations

import logging
from typing import Any

from trainer.errors import SettingError

log = logging.getLogger(__name__)


def chatml(start: str = "<|im_start|>", end: str = "<|im_end|>") -> str:
    """ChatML with the assistant's content and its end-of-turn token inside the generation markers.

    `<start>role\\ncontent<end>\\n` per message; `add_generation_prompt` opens an assistant turn. The
    end-of-turn token is part of the assistant's loss, so the model learns to stop.
    """
    return (
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}"
        f"{{{{- '{start}assistant\\n' }}}}"
        f"{{% generation %}}{{{{- message['content'] + '{end}' }}}}{{% endgeneration %}}"
        "{{- '\\n' }}"
        "{%- else %}"
        f"{{{{- '{start}' + message['role'] + '\\n' + message['content'] + '{end}\\n' }}}}"
        "{%- endif %}"
        "{%- endfor %}"
        f"{{%- if add_generation_prompt %}}{{{{- '{start}assistant\\n' }}}}{{%- endif %}}"
    )


SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MARKED_COPIES = {SMOLLM2: SMOLLM2_MARKED}  # stock template -> marked copy that renders the same text


def has_markers(template: str | None) -> bool:
    return bool(template) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def training_template(tokenizer, samples: list[list[dict[str, Any]]]) -> str | None:
    """The template to train with for assistant-only loss: None when the tokenizer's own is marked.

    `samples` are conversations from the training data; a marked copy must render each of them exactly
    like the original template does.
    """
    original = tokenizer.chat_template
    if not original:
        raise SettingError("assistant_only_loss", "the tokenizer has no chat template; use a tokenizer stage's "
                           "output (its template marks assistant turns) or set assistant_only_loss: false")
    if has_markers(original):
        return None
    marked = MARKED_COPIES.get(original)
    if marked is None:
        try:
            from trl.chat_template_utils import get_training_chat_template

            marked = get_training_chat_template(tokenizer)
        except ValueError:
            marked = None
    if marked is None:
        raise SettingError("assistant_only_loss", "the tokenizer's chat template has no {% generation %} markers and "
                           "neither lmforge nor TRL has a marked copy of it; set assistant_only_loss: false (loss on "
                           "every token) or train with a tokenizer whose template marks assistant turns")
    for messages in samples:
        a = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=original)
        b = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=marked)
        if a != b:
            raise SettingError("assistant_only_loss", "the marked copy of the tokenizer's chat template renders "
                               f"differently from the original (first conversation: {a[:120]!r} vs {b[:120]!r}); "
                               "set assistant_only_loss: false")
    log.info("assistant-only loss: using a marked copy of the tokenizer's chat template (renders %d sample "
             "conversations byte-identical)", len(samples))
    return marked
