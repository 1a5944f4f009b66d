#!/usr/bin/env bash
# The long-context demonstration of docs/eval.md on a CPU: the embedded corpus prepared with
# streams; the demo's GPN+M trained on independent windows, with the state carried, and with the state
# carried but reset after each EOS (the same steps, batch and tokens), a GDN with carried state and a
# Transformer++ on windows beside them;
# each scored with `eval --context` and `--passkey`. Usage: scripts/long_context_demo.sh OUT [STEPS]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
OUT=${1:?usage: scripts/long_context_demo.sh OUT [STEPS]}
STEPS=${2:-300}
CONTEXT=16128  # 63 windows of 256: the shorter of the corpus's two held-out streams
PASSKEY=16384
mkdir -p "$OUT"
export DS_ACCELERATOR=cpu WANDB_MODE=disabled

if [ ! -f "$OUT/data/stats.json" ]; then
  python -c "import sys; from pathlib import Path; from data_prep.embedded import write_embedded_corpus; write_embedded_corpus(Path(sys.argv[1]))" "$OUT/corpus"
  files=("$OUT"/corpus/*.parquet)
  [ -f "$OUT/tokenizer.json" ] || python -m gpn_scale prep train-tokenizer "${files[@]}" --vocab-size 2048 --out "$OUT/tokenizer.json"
  python -m gpn_scale prep "${files[@]}" --out "$OUT/data" --tokenizer "$OUT/tokenizer.json" --seq-len 256 \
    --val-files "${files[-1]}" --workers 1 --streams 8 --val-streams 2
fi

# name, model, data.train, extra overrides: the same global batch (8) and steps for all
runs=(
  "gpn_m_windows gpn_m_demo $OUT/data/train"
  "gpn_m_carried gpn_m_demo $OUT/data/streams/train train.carry_state=true"
  "gpn_m_carried_reset gpn_m_demo $OUT/data/streams/train train.carry_state=true train.reset_on_eos=true"
  "gdn_carried gdn_demo $OUT/data/streams/train train.carry_state=true"
  "transformer_windows transformer_demo $OUT/data/train"
)
for spec in "${runs[@]}"; do
  read -r name model train extra <<<"$spec"
  run="$OUT/runs/$name"
  if [ ! -f "$run/status.json" ] || ! grep -q finished "$run/status.json"; then
    resume=none; [ -d "$run/checkpoints" ] && resume=auto
    python -m gpn_scale train demo "model=$model" "run.dir=$run" "data.train=$train" "data.val=$OUT/data/val" \
      train.micro_batch=8 "train.total_steps=$STEPS" "train.save_every=$STEPS" eval.every=0 ${extra:-} --resume "$resume"
  fi
  reset=(); [[ "$extra" == *reset_on_eos=true* ]] && reset=(--reset-on-eos)  # read as it was trained
  [ -d "$OUT/eval/$name" ] || python -m gpn_scale eval "$run" --data "$OUT/data" --context "$CONTEXT" \
    --passkey "$PASSKEY" --passkey-trials 10 --batch 2 "${reset[@]}" --out "$OUT/eval/$name"
done

python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| run | held-out loss (windows from empty state) | loss, carried context: " +
      " | ".join(f"{b['positions'][0]}-{b['positions'][1]}" for b in
                 json.loads(next((out / "eval").glob("*/metrics.json")).read_text())["context"]["bins"][6:]) + " |")
for m in sorted((out / "eval").glob("*/metrics.json")):
    r = json.loads(m.read_text())
    bins = " | ".join(f"{b['loss']:.3f}" for b in r["context"]["bins"][6:])
    print(f"| {m.parent.name} | {r['loss']:.3f} | {bins} |")
print()
for m in sorted((out / "eval").glob("*/metrics.json")):
    r = json.loads(m.read_text())["passkey"]["by_distance"]
    print(m.parent.name, "passkey accuracy:", ", ".join(f"{x['distance']}: {x['accuracy']:.1f}" for x in r),
          "| mean log p(key):", ", ".join(f"{x['mean_key_logprob']:.1f}" for x in r))

# every run's binned curve in one figure
import math
from gpn_scale.eval.report import _plain_log_ticks, _pyplot, _save
plt = _pyplot()
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
for m in sorted((out / "eval").glob("*/metrics.json")):
    r = json.loads(m.read_text())
    bins = r["context"]["bins"]
    left.plot([math.sqrt(b["positions"][0] * b["positions"][1]) for b in bins], [b["loss"] for b in bins], "o-",
              label=m.parent.name)
    keys = r["passkey"]["by_distance"]
    right.plot([k["distance"] for k in keys], [k["mean_key_logprob"] for k in keys], "o-", label=m.parent.name)
left.axvline(256, color="gray", ls=":", lw=1, label="training window (256)")
right.axhline(r["passkey"]["chance"]["key_logprob"], color="gray", ls=":", lw=1, label="chance (uniform key)")
left.set(xscale="log", xlabel="position in the held-out stream (tokens, log)", ylabel="loss (nats)",
         title="Loss by position, state (or KV cache) carried")
right.set(xscale="log", xlabel="distance (tokens, log)", ylabel="mean log p(key)", title="Passkey: key log-probability")
for ax in (left, right):
    _plain_log_ticks(ax.xaxis)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
print("figure:", _save(fig, out / "long_context.png"))
EOF
