# Sourced by the GPU topic scripts: installs the carried wheels (.whl) into /tmp/site for this run, once per
# machine and set of wheels (scripts that run side by side in one call must not reinstall under each other).
if [ -d .whl ]; then
  stamp="/tmp/site/.carried-$(ls .whl | md5sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1 && touch "$stamp" || echo "warning: wheel install failed"
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1

pack_out() {  # NAME: every log and small file under $OUT except wheels and archives into $OUT/NAME.tgz
  local name=$1 tmp
  tmp=$(mktemp /tmp/pack.XXXXXX)  # scripts may pack side by side
  (cd "$OUT" && find . -type f ! -name '*.whl*' ! -name '*.tgz' -size -8M -print0 | tar czf "$tmp" --null -T -
   find . -type f ! -name '*.whl*' ! -name '*.tgz' -delete; find . -mindepth 1 -type d -empty -delete)
  mv "$tmp" "$OUT/$name.tgz"
}
