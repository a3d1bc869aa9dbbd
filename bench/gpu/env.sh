# Source from the repository root on a machine without the package installed (the device tool's GPU
# machine): installs the wheels in .whl/ (lark, pydantic, pydantic-core, annotated-types,
# typing-inspection, graphviz) into /tmp/site and puts it and the checkout on PYTHONPATH.
if [ -d .whl ] && [ ! -e /tmp/site/lark ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ln -sfn ../grammar plandsl/grammar; ln -sfn ../stdlib_plans plandsl/stdlib_plans
