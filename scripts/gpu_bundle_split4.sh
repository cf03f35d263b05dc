#!/usr/bin/env bash
# Re-cut the GPU bundle's core tar (../shared/gpu/build_bundle.sh: three parts of ~58 MiB in
# .gpu/p0..p2) into four parts of ~44 MiB (.gpu/p0, p1, p2, p5), so that one part plus this
# repository's tracked files stay under the 64 MiB a device call may carry. Patches the
# bundle's stage.sh / install.sh to know part 3. Stage p0, p1, p5 (and p3 / p4 when needed)
# before p2, as in ../shared/gpu/README.md. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.gpu"
if [ -f p5/core.part.03 ]; then echo "already in four parts"; exit 0; fi
tmp=$(mktemp -d)
cat p0/core.part.00 p1/core.part.01 p2/core.part.02 > "$tmp/core.tar"
rm p0/core.part.00 p1/core.part.01 p2/core.part.02
(cd "$tmp" && split -n 4 -d core.tar core.part. && rm core.tar)
mkdir -p p5
mv "$tmp/core.part.00" p0/ && mv "$tmp/core.part.01" p1/ && mv "$tmp/core.part.02" p2/
mv "$tmp/core.part.03" p5/
rmdir "$tmp"
sed -i 's#for d in .gpu/p0 .gpu/p1 .gpu/p2 .gpu/p3 .gpu/p4;#for d in .gpu/p0 .gpu/p1 .gpu/p2 .gpu/p3 .gpu/p4 .gpu/p5;#' bin/stage.sh
sed -i 's#ls $S/core.part.00 $S/core.part.01 $S/core.part.02 >#ls $S/core.part.00 $S/core.part.01 $S/core.part.02 $S/core.part.03 >#' bin/install.sh
grep -q p5 bin/stage.sh && grep -q core.part.03 bin/install.sh || { echo "could not patch stage.sh / install.sh" >&2; exit 1; }
du -sh p0 p1 p2 p5
