"""Evaluation, the paper's analyses, ablations and generation for trained models.

    prep_output.py  held-out windows of a prep output, its tokenizer, and the checks against a model
    codec.py      text <-> token ids through the prep's tokenizer; incremental decoding (text as it is generated)
    heldout.py    perplexity and the per-position loss curve
    lambada.py    LAMBADA accuracy and perplexity (any model family)
    states.py     per-step predicted states and memory decays, recorded through the model's hooks
    geometry.py   geometry of the states and their mean direction s-bar
    horizons.py   state-similarity horizon c_k
    memory.py     memory retention, half-lives and the fast / slow pools
    ablations.py  PPL with s-bar projected out, memory pools silenced
    analyze.py    all of the analyses on a model and its held-out windows
    report.py     report.json, report.md and the figures
    generate.py   sampling with O(1) memory per token, batch scoring
    harness.py    lm-evaluation-harness requests scored with the recurrent state carried (torch only)
    lm_eval_model.py  the harness's model `gpn-scale` (imports lm_eval)
    lm_eval_run.py    `gpn-scale lm-eval`: tasks resolved, the harness run through its Python API, results written
    cli.py        `gpn-scale eval | analyze | generate | lm-eval`
"""
