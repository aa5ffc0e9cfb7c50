#!/usr/bin/env bash
# Set up and run the whole test suite: installs the storage servers the tests start (redis-server,
# moto, SeaweedFS, Valkey, Azurite), the vLLM CPU and SGLang environments and the CUDA vLLM wheels' sources,
# makes sure Redis answers on 6379.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-services.sh
if [ -f scripts/setup-vllm.sh ]; then bash scripts/setup-vllm.sh; fi
bash scripts/setup-vllm-wheels.sh  # the CUDA vLLM 0.33 / 0.34 sources the connector is checked against
if [ -f scripts/setup-dynamo.sh ]; then bash scripts/setup-dynamo.sh; fi  # after setup-vllm: it adds the Dynamo wheels to .venv-vllm
if [ -f scripts/setup-sglang.sh ]; then bash scripts/setup-sglang.sh; fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "test: starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/kvtier-ci-redis.log
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
# two workers: the engine tests on one, one after another; the rest on the other (tests/conftest.py)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --durations=15 "$@"
