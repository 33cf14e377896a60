# Sourced by the lent-GPU scripts, from the project root, with OUT set: wheels the machine lacks (x-transformers and
# its needs) from .whl/ when present, PYTHONPATH, and the versions in $OUT/versions.txt.
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    echo "commit ${COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
# The files that hold the tests needing a CUDA device (named on_cuda), found rather than listed: pytest is given only
# those, so modules importing the recipes' needs (datasets, evaluate), which a lent machine may lack, are not collected
mapfile -t CUDA_TEST_FILES < <(grep -l "def test_.*on_cuda" tests/test_*.py)
