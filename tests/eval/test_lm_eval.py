"""lm-evaluation-harness adapter: `gpn-scale lm-eval` on a local lambada-style task agrees per example
with `gpn-scale eval --lambada`, and per request with `lm_eval --model hf` on the HF export; the three
request kinds against one-forward references; state batching in segments; nothing downloaded (HF
offline, task YAMLs over a JSON file the test writes)."""

import json
import math
import os

import pytest
import torch
from support.eval_fixtures import SENTENCES, corpus_texts, make_prep, make_tokenizer, tiny_model, train

pytest.importorskip("lm_eval")

from gpn_scale.cli import main  # noqa: E402
from data_prep.errors import UserError  # noqa: E402
from gpn_scale.eval import harness  # noqa: E402
from gpn_scale.eval.codec import Codec  # noqa: E402
from gpn_scale.eval.prep_output import open_prep_output, read_windows  # noqa: E402
from gpn_scale.eval.generate import generate_tokens, score_texts  # noqa: E402
from gpn_scale.storage.native import save_native  # noqa: E402
from support import ROOT

TEXTS = [
    "the cat sat on the mat and the dog sat on the log",
    "seven small ships sailed past the lighthouse at dawn",
    "river stones roll slowly under the cold water of the valley",
    "a naive café serves crème brûlée to the ünïcode crowd",
    "the dog sat on the cat",
    "seven small ships sat on the",
]

TASK_YAML = """\
task: local_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A prep output with BOS (so the adapter must prepend it as eval does) and a GPN+M trained on it."""
    root = tmp_path_factory.mktemp("lm_eval")
    with pytest.MonkeyPatch.context() as mp:
        # The harness reads tasks through `datasets`: offline, with its caches here, nothing fetched.
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            mp.setenv(name, "1")
        mp.setenv("HF_HOME", str(root / "hf"))
        tok = make_tokenizer(root / "tok.json")
        for name, seed in (("train", 0), ("val", 1)):
            (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(60, seed)))
        prep = root / "prep"
        assert main(["prep", str(root / "train.jsonl"), str(root / "val.jsonl"), "--val-files", str(root / "val.jsonl"),
                     "--out", str(prep),
                     "--tokenizer", str(tok), "--seq-len", "32", "--workers", "1", "--bos"]) == 0
        stats = json.loads((prep / "stats.json").read_text())
        assert stats["add_bos"]
        # torch kernels: the adapter does not depend on them, and no C++ build is paid for here
        model = train(tiny_model(stats["vocab_size"], kernel="torch"), read_windows(open_prep_output(prep / "train")), steps=60)
        save_native(model, root / "ckpt")
        yield root, prep, model, stats


def test_harness_lambada_agrees_with_eval_per_example(setup, tmp_path, capsys):
    root, prep, model, stats = setup
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_lambada.yaml").write_text(TASK_YAML.format(data=data))

    assert main(["eval", str(root / "ckpt"), "--lambada", str(data), "--data", str(prep), "--windows", "1",
                 "--batch", "4", "--out", str(tmp_path / "eval")]) == 0
    ours = [json.loads(line) for line in (tmp_path / "eval" / "lambada_examples.jsonl").read_text().splitlines()]

    assert main(["lm-eval", str(root / "ckpt"), "--data", str(prep), "--tasks", "local_lambada",
                 "--include_path", str(tasks), "--batch_size", "4", "--output_path", str(tmp_path / "harness"),
                 "--log_samples"]) == 0
    capsys.readouterr()
    (samples_file,) = (tmp_path / "harness").rglob("samples_local_lambada_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    (results_file,) = (tmp_path / "harness").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["local_lambada"]

    assert [s["doc"]["text"] for s in samples] == TEXTS
    harness_ll = [float(s["resps"][0][0][0]) for s in samples]  # the samples file holds them as text
    harness_greedy = [s["resps"][0][0][1] == "True" for s in samples]
    assert harness_ll == pytest.approx([o["target_logprob"] for o in ours], rel=1e-5, abs=1e-5)

    # By hand: one forward of BOS + context + " word" per example; the harness's acc is every target
    # subword the argmax, its perplexity exp of minus the mean summed log-likelihood.
    tok = Codec(prep / stats["tokenizer"]["copy"])
    greedy = []
    for text in TEXTS:
        context, word = text.rsplit(" ", 1)
        ctx, tgt = [stats["bos_id"]] + tok.encode(context), tok.encode(" " + word)
        with torch.no_grad():
            logits = model(torch.tensor([ctx + tgt]), return_logits=True).logits[0]
        greedy.append(logits[len(ctx):].argmax(-1).tolist() == tgt)
    assert harness_greedy == greedy and any(greedy) and not all(greedy)
    assert results["acc,none"] == pytest.approx(sum(greedy) / len(greedy))
    assert results["perplexity,none"] == pytest.approx(math.exp(-sum(harness_ll) / len(harness_ll)), rel=1e-6)


def requests(*args_list):
    from lm_eval.api.instance import Instance

    return [Instance("x", {}, args, i) for i, args in enumerate(args_list)]


@pytest.fixture(scope="module")
def lm(setup):
    from gpn_scale.eval.lm_eval_model import GPNScaleLM

    root, prep, _, _ = setup
    return GPNScaleLM(str(root / "ckpt"), data=str(prep), batch_size=3)


def test_shared_contexts_and_empty_contexts_match_one_forward_each(setup, lm):
    _, _, model, stats = setup
    pairs = [("the cat sat", " on"), ("the cat sat", " on the mat"), ("river stones", " roll"), ("", "the dog"),
             ("seven small ships sailed past", " the"), ("the cat sat", " by")]
    got = lm.loglikelihood(requests(*pairs))
    for (context, continuation), (logprob, _) in zip(pairs, got):
        ctx = [stats["bos_id"]] + lm.codec.encode(context)
        cont = lm.codec.encode(continuation)
        with torch.no_grad():
            losses = model(torch.tensor([ctx + cont])).token_losses[0, len(ctx):].double()
        assert logprob == pytest.approx(-float(losses.sum()), rel=1e-5, abs=1e-5)


def test_final_states_in_segments_equal_each_row_alone(setup):
    _, _, model, _ = setup
    rows = [[5, 9, 11], [7], [5, 9, 11, 30, 2], [8, 8], [3, 4, 5, 6, 7]]
    states = harness.final_states(model, rows)
    for row, state in zip(rows, states):
        with torch.no_grad():
            alone = model(torch.tensor([row])).state
        for a, b in zip(state, alone):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rolling_equals_one_forward_per_text_also_in_chunks(setup, lm):
    _, _, model, stats = setup
    texts = ["the cat sat on the mat", "seven small ships sailed past the lighthouse at dawn and the dog sat", "river"]
    reference = [-r["loss_sum"] for r in score_texts(model, lm.codec.encode, texts, bos_id=stats["bos_id"])]
    assert lm.loglikelihood_rolling(requests(*[(t,) for t in texts])) == pytest.approx(reference, rel=1e-5)
    ids = [[stats["bos_id"]] + lm.codec.encode(t) for t in texts]
    assert harness.score_rolling(model, ids, first=1, batch=2, chunk=4) == pytest.approx(reference, rel=1e-5)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(setup, lm):
    _, _, model, stats = setup
    prompts = ["the cat sat", "seven small", "river stones roll"]
    reference = []
    for prompt in prompts:
        ids = [stats["bos_id"]] + lm.codec.encode(prompt)
        tokens = []
        for token, _ in generate_tokens(model, ids, 12, temperature=0):
            if token == stats["eos_id"]:
                break
            tokens.append(token)
        reference.append(lm.codec.decode(tokens))
    stop = reference[0].strip().split(" ")[1]  # a word the first generation contains, so it is cut there
    got = lm.generate_until(requests(*[(p, {"until": [" " + stop], "max_gen_toks": 12}) for p in prompts]))
    assert got == [r.split(" " + stop)[0] for r in reference]
    assert got[0] != reference[0]  # the stop string did cut


def test_a_transformer_is_refused_in_one_line(setup):
    from gpn_scale.models import TransformerConfig, build_model

    model = build_model(TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ffn=32))
    with pytest.raises(UserError, match="transformer: the harness adapter carries fixed-size recurrent states"):
        harness.check_stateful(model)


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["lm-eval", str(tmp_path / "nope"), "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such checkpoint"


def test_adapter_scoring_imports_without_the_harness():
    import subprocess
    import sys

    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "import gpn_scale.eval.harness, gpn_scale.eval.cli")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


# ---- one score whatever the route: `gpn-scale lm-eval` and `lm_eval --model hf` on the HF export --------------

# One task per request kind, over the same documents. A multiple-choice question left empty asks from the
# start of text (the harness's empty context: a BOS prefix by the hf route, the initial state by ours).
ROUTE_TASKS = {
    "local_ll": "output_type: loglikelihood\ndoc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\nmetric_list:\n  - metric: acc\n",
    "local_mc": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n",
    "local_roll": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                  "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


@pytest.fixture(scope="module")
def routes(setup, tmp_path_factory):
    """A GPN+M trained without BOS and one trained with it, each as a native export framed as its data
    (tokenizer.yaml) and as an HF export of that; the task YAMLs and their documents."""
    from gpn_scale.export import Source, write_native

    root = setup[0]
    tok = root / "tok.json"
    models = {}
    for name, bos in (("plain", False), ("bos", True)):
        d = tmp_path_factory.mktemp(f"route_{name}")
        prep = make_prep(d / "data", tok, bos=bos)
        model = train(tiny_model(Codec(tok).vocab_size), read_windows(open_prep_output(prep / "train")), steps=30)
        (d / "native").mkdir()
        write_native(Source(model, d), open_prep_output(prep).tokenizer_source(), d / "native")
        assert main(["export", str(d / "native"), "--to", "hf", "--out", str(d / "hf")]) == 0
        models[name] = (d / "native", d / "hf")
    tasks = tmp_path_factory.mktemp("route_tasks")
    docs = []
    for i, text in enumerate(SENTENCES + corpus_texts(4, 3)):
        words = text.split()
        docs.append({"text": text, "question": "" if i % 3 == 0 else " ".join(words[:3]),
                     "choices": [" ".join(words[3:6]), " ".join(words[5:8])], "answer": i % 2})
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for task, body in ROUTE_TASKS.items():
        (tasks / f"{task}.yaml").write_text(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {tasks / 'docs.jsonl'}\ntest_split: test\n{body}")
    return models, tasks


@pytest.mark.parametrize("name", ["plain", "bos"])
def test_every_route_gives_the_same_score_per_request(routes, name, tmp_path, capsys):
    """Per request, within 1e-6 of the score (float32 sums, in another order) plus 1e-5 nats: loglikelihood, multiple choice (an empty context among them) and
    rolling loglikelihood, for a model whose training data had no BOS and one whose data began each
    document with BOS."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    models, tasks = routes
    native, hf = models[name]
    assert main(["lm-eval", str(native), "--tasks", ",".join(ROUTE_TASKS), "--include_path", str(tasks),
                 "--batch_size", "3", "--output_path", str(tmp_path), "--log_samples", "--bootstrap_iters", "0"]) == 0
    capsys.readouterr()
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(hf), "trust_remote_code": True, "device": "cpu", "dtype": "float32"},
        tasks=list(ROUTE_TASKS), task_manager=TaskManager(include_path=str(tasks), include_defaults=False), batch_size=3, log_samples=True,
        bootstrap_iters=0)["samples"]
    empty_contexts = 0
    for task in ROUTE_TASKS:
        (path,) = tmp_path.rglob(f"samples_{task}_*.jsonl")
        ours = {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}
        assert sorted(ours) == sorted(s["doc_id"] for s in theirs[task]) == list(range(8))
        for sample in theirs[task]:
            mine = ours[sample["doc_id"]]
            for resp, my_resp in zip(sample["resps"], mine["resps"], strict=True):
                if task == "local_roll":
                    assert float(my_resp[0]) == pytest.approx(resp[0], rel=1e-6, abs=1e-5)
                else:
                    logprob, greedy = resp[0]
                    assert float(my_resp[0][0]) == pytest.approx(logprob, rel=1e-6, abs=1e-5)
                    assert my_resp[0][1] == str(greedy)
            empty_contexts += task == "local_mc" and sample["doc"]["question"] == ""
    assert empty_contexts == 3


def test_an_unknown_task_is_one_line_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()  # not a checkpoint: the task is refused before anything reads it
    assert main(["lm-eval", str(tmp_path / "ckpt"), "--tasks", "no_such_task"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tasks: unknown task 'no_such_task'") and len(err.strip().splitlines()) == 1, err
    assert main(["lm-eval", str(tmp_path / "ckpt"), "--tasks", "x", "--include_path", str(tmp_path / "nope")]) == 2
    assert "--include_path: " in capsys.readouterr().err
