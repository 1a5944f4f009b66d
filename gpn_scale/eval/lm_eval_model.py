"""A checkpoint as lm-evaluation-harness's model `gpn-scale` (importing this module registers it).

    gpn-scale lm-eval runs/a --tasks lambada_openai --batch_size 16
    lm_eval.simple_evaluate(model="gpn-scale", model_args={"pretrained": "runs/a"}, tasks=[...])  # after import

model_args: `pretrained` (a native checkpoint, a training checkpoint or a run directory), optional
`tokenizer` (a tokenizer file) and `data` (a prep output whose tokenizer to use); by default the
tokenizer of the data the checkpoint was trained on, as for `gpn-scale eval`. BOS is prepended to
every context when that prep added one. The scoring itself is `gpn_scale.eval.harness`.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  the harness's own models (hf, ...), registered before ours: the harness
# imports them only into an empty registry, so without this `gpn-scale` would hide them in this process
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from data_prep.errors import UserError
from gpn_scale.eval import harness

DEFAULT_BATCH = 16
DEFAULT_MAX_GEN_TOKS = 256


@register_model("gpn-scale")
class GPNScaleLM(LM):
    def __init__(self, pretrained: str, tokenizer: str | None = None, data: str | None = None,
                 batch_size: int | str = DEFAULT_BATCH, device: str = "cpu", seed: int = 0, **_unused):
        super().__init__()
        from gpn_scale.eval.loading import DATA_OR_TOKENIZER, load_checkpoint
        from gpn_scale.eval.prep_output import choose_tokenizer, open_prep_output, training_prep

        self.model = load_checkpoint(str(pretrained), device or "cpu").eval()
        harness.check_stateful(self.model)
        data_dir = open_prep_output(data) if data else None
        self.codec, framing = choose_tokenizer(str(pretrained), tokenizer, data_dir, training_prep(pretrained),
                                               self.model, DATA_OR_TOKENIZER)
        self.prefix = [] if framing.prompt_bos is None else [framing.prompt_bos]
        self.eos_id = self.codec.eos_id if framing.eos_id is None else framing.eos_id
        # "auto" (the harness's batch-size search) has nothing to search here: a recurrent model's
        # memory does not grow with the context, so the default is used.
        self.batch = DEFAULT_BATCH if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch < 1:
            raise UserError(f"batch_size: expected a positive integer, got {batch_size}")
        self.seed = int(seed)

    def _encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        contexts, continuations = [], []
        for request in requests:
            context, continuation = request.args
            # The harness's own rules (`TemplateLM._encode_pair`), so that every route scores the same
            # tokens: a context's trailing whitespace belongs to the continuation (tokenizers attach a
            # word's leading space to the word), and the continuation is what encoding the whole text
            # adds to encoding the context. An empty context is the start of text: the model's initial state.
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            context_ids = self._encode(context) if context else []
            whole = self._encode(context + continuation) if context else self._encode(continuation)
            contexts.append(self.prefix + context_ids)
            continuations.append(whole[len(context_ids):])
            if not continuations[-1]:
                raise UserError(f"loglikelihood request {len(continuations)}: the continuation {continuation!r} "
                                "encodes to no tokens")
        scored = harness.score_continuations(self.model, contexts, continuations, self.batch)
        results = [(s.logprob, s.greedy) for s in scored]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [self.prefix + self._encode(request.args[0]) for request in requests]
        results = harness.score_rolling(self.model, texts, first=len(self.prefix), batch=self.batch)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        generations = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sample = bool(kwargs.get("do_sample", False))
            generations.append(harness.Generation(
                self.prefix + self._encode(context), until,
                int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
                float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                float(kwargs.get("top_p", 1.0)) if sample else 1.0))
        texts = []
        for start in range(0, len(generations), self.batch):
            texts += harness.generate_batch(self.model, generations[start : start + self.batch], self.codec.decode,
                                            self.eos_id, self.seed + start)
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts
