# Sourced by the device-machine scripts (bench/*_h200.sh): installs the wheels carried in .whl/
# for what the image lacks (opentelemetry-{api,sdk,proto,exporter-otlp-proto-grpc,
# exporter-otlp-proto-common,semantic-conventions}, googleapis-common-protos, grpcio >= 1.85 (the
# image has 1.84), grpcio-{health-checking,reflection}, starlette, uvicorn, click, h11,
# prometheus-client, dflash; pytest-asyncio for the tests: `pip download --no-deps` the versions
# .venv has, grpcio for cp312 manylinux x86_64), puts the repo and bench/ on PYTHONPATH (not
# installed there) and makes $OUT.
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 GRPC_VERBOSITY=ERROR TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
