"""PPO's rollouts: the prompts each update samples from, where the reward model reads a rollout, the held-out check,
and the reward model's fit to the policy (trainer/ppo.py runs them).

Where the reward is read: TRL's PPO scores a rollout at its last token, the eos that ends the response. A reward
stage on a chat template learned from whole turns, which end after the eos (ChatML: "<|im_end|>" and a newline),
and ranks its pairs well only when read at that end of turn, no better than chance at the bare eos. So the
reward model reads each eos-terminated rollout with the template's end of turn appended (`turn_end_suffix`),
exactly the token ids it was trained on; plain-text reward models (RewardTrainer appends eos) need nothing.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

from trainer import models
from trainer.errors import SettingError
from trainer.settings import PpoSettings

log = logging.getLogger(__name__)


def turn_end_suffix(tokenizer) -> list[int]:
    """Token ids the chat template writes after an assistant turn's eos (ChatML: a newline after "<|im_end|>")."""
    if not tokenizer.chat_template:
        return []  # plain text: RewardTrainer ends every text with eos, as a rollout ends
    probe = "lmforge probe answer"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}],
                                         tokenize=False)
    tail = text[text.rindex(probe) + len(probe):]
    if not tokenizer.eos_token or not tail.startswith(tokenizer.eos_token):
        log.warning("the chat template does not end an assistant turn with eos %r (it writes %r): the reward model "
                    "reads each rollout at its last token", tokenizer.eos_token, tail)
        return []
    rest = tail[len(tokenizer.eos_token):]
    return tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []


def append_turn_end(query_responses, pad_token_id: int, context_length: int, suffix: list[int], eos_token_id: int):
    """`query_responses` (left-padded prompts + responses padded after their eos) with `suffix` written after each
    response that ends with eos, where TRL's `get_reward` reads the score; one more block of pad columns."""
    import torch
    from trl.experimental.utils import first_true_indices

    rows = query_responses.shape[0]
    out = torch.cat([query_responses, query_responses.new_full((rows, len(suffix)), pad_token_id)], 1)
    ends = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    tail = torch.tensor(suffix, dtype=out.dtype, device=out.device)
    last = query_responses[torch.arange(rows, device=out.device), ends]
    for i in torch.nonzero(last == eos_token_id).flatten().tolist():
        out[i, ends[i] + 1:ends[i] + 1 + len(suffix)] = tail
    return out


def rollout_pad_token(tokenizer, rows: list[dict[str, Any]], suffix: list[int]) -> str | None:
    """The token PPO pads with, when the tokenizer's own pad cannot serve (None: it can).

    TRL's PPO tells padding from text by id alone: the attention mask of every forward (generation, policy, value,
    reward) is `ids != pad`, a response ends one token before its first pad, and the reward is read there. A
    tokenizer whose pad is its eos (SmolLM2's <|im_end|>, which also ends every system and user turn of a chat
    prompt) would hide every end of turn of the prompt from all three models, leave the eos out of the policy's
    loss, and read the reward one token before the eos, where the reward model never read a training pair. So PPO
    pads with a special token that is not the eos and occurs in no prompt and not in the end of turn."""
    eos = tokenizer.eos_token_id
    used = {t for r in rows for t in r["input_ids"]} | set(suffix) | {eos}
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in used:
        return None
    specials = list(tokenizer.all_special_ids) + sorted(i for i, t in tokenizer.added_tokens_decoder.items()
                                                        if t.special)
    for i in specials:
        if i not in used:
            return tokenizer.convert_ids_to_tokens(i)
    raise SettingError("inputs", f"the policy's tokenizer pads with {tokenizer.pad_token!r}, which is its eos or "
                       "occurs in the prompts, and it has no other special token to pad with: TRL's PPO tells "
                       "padding from text by id, so add a pad token to the tokenizer the sft stage trains on")


class RolloutBatches:
    """This process's prompt batches for updates `start` .. `total`-1, a pure function of the seed.

    The prompts are taken in a seeded permutation, reshuffled on every pass over them; update u uses the
    `per_update` prompts from position u * per_update on, of which this process takes its `local` slice.
    (TRL's own DataLoader reshuffles from the global RNG, so its position cannot be restored.)
    """

    def __init__(self, rows: list[dict[str, Any]], collate, *, seed: int, start: int, total: int, per_update: int,
                 local: int, process: int):
        self.rows, self.collate, self.seed = rows, collate, seed
        self.start, self.total, self.per_update, self.local, self.process = start, total, per_update, local, process
        self._perms: dict[int, list[int]] = {}

    def _row(self, position: int) -> dict[str, Any]:
        import torch

        epoch, i = divmod(position, len(self.rows))
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.rows), generator=g).tolist()}
        return self.rows[self._perms[epoch][i]]

    def __iter__(self):
        for update in range(self.start, self.total):
            first = update * self.per_update + self.process * self.local
            yield self.collate([{"input_ids": self._row(p)["input_ids"]} for p in range(first, first + self.local)])


def check_reward_model(reward_model, reward_tokenizer, tokenizer, s: PpoSettings, describe: str) -> None:
    """The reward model must read the policy's tokens and fit a whole rollout."""
    if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SettingError("inputs", f"the reward model ({describe}) has another tokenizer than the policy "
                           f"({len(reward_tokenizer)} vs {len(tokenizer)} tokens): PPO scores the policy's token ids "
                           "directly, so train the reward stage on the same tokenizer (e.g. on the sft stage's model)")
    limit = models.max_positions(reward_model.config)
    if limit is not None and s.max_length_tokens > limit:
        raise SettingError("max_length_tokens", f"{s.max_length_tokens} is beyond the reward model's "
                           f"max_position_embeddings {limit} ({describe}); set max_length_tokens to {limit} or less")


def heldout_rewards(trainer, prompts: list[dict[str, Any]], tokenizer, s: PpoSettings) -> list[dict[str, Any]]:
    """Greedy responses of the trained policy and of the reference to `prompts`, scored by the reward model as
    in training (`get_reward` of the trainer: the response cut after its eos, the end of turn appended).
    `token_ids` are the sequence the reward model read, its score at the last one."""
    import torch
    from transformers import GenerationConfig
    from trl.experimental.ppo.ppo_trainer import batch_generation, truncate_response

    policy, pad, eos = trainer.policy, tokenizer.pad_token_id, tokenizer.eos_token_id
    gen = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    models_ = {"policy": (policy, nullcontext)}
    models_["reference"] = ((trainer.ref_model, nullcontext) if trainer.ref_model is not None
                            else (policy, policy.disable_adapter))
    out = [{"prompt": p["prompt"]} for p in prompts]
    device = trainer.accelerator.device
    policy.eval()
    for name, (model, context) in models_.items():
        for lo in range(0, len(prompts), s.batch_size_per_device):
            chunk = prompts[lo:lo + s.batch_size_per_device]
            queries = trainer.data_collator([{"input_ids": p["input_ids"]} for p in chunk])["input_ids"].to(device)
            n = queries.shape[1]
            with torch.no_grad(), context():
                sequences, _ = batch_generation(model, queries, len(chunk), pad, gen)
                responses = truncate_response(eos, pad, sequences[:, n:])
                query_responses = torch.cat((queries, responses), 1)
                _, scores, _ = trainer.get_reward(trainer.reward_model, query_responses, pad, n)
                read = (append_turn_end(query_responses, pad, n, trainer.turn_end, eos) if trainer.turn_end
                        else query_responses)
            for j, p in enumerate(chunk):  # get_reward reads up to the first pad (filled in after the eos)
                response, read_ids = _until(responses[j].tolist(), pad), _until(read[j, n:].tolist(), pad)
                out[lo + j][name] = {"response": tokenizer.decode(response), "reward": float(scores[j]),
                                     "token_ids": p["input_ids"] + read_ids}
    return out


def _until(ids: list[int], stop: int) -> list[int]:
    return ids[:ids.index(stop)] if stop in ids else ids
