"""Lists the YNNPACK fusions that hold both a product and a reduction in XLA:CPU's optimised HLO dumps (the fusion
kind jax-ml/jax#39103 computes wrong in jaxlib 0.10.2: a product whose output a reduction in the same fusion sums
over a narrow dimension; docs/performance.md, "Eigen's fault is a regression of jaxlib 0.6.2"). One line per
distinct fusion: its count, the dump file, the products' output shapes, the reductions' output shapes and reduced
dimensions, and which comes first in the fusion (a norm's reduction feeding a product is not the faulting kind).

    XLA_FLAGS=--xla_dump_to=DIR python ...            # any stare-jax command
    python docs/bench/epyc_zen5/scan_ynn_product_reductions.py DIR/*after_optimizations.txt
"""
import collections
import re
import sys


def main():
    found = collections.Counter()
    for path in sys.argv[1:]:
        text = open(path).read()
        bodies = {m.group(1): m.group(2) for m in re.finditer(
            r"^%?([\w.\-]+) \([^\n]*\) -> [^\n]*\{\n(.*?)\n\}", text, re.S | re.M)}
        for m in re.finditer(r"fusion\([^\n]*calls=%?([\w.\-]+)[^\n]*__ynn_fusion", text):
            body = bodies.get(m.group(1), "")
            dots = [(d.start(), d.group(1)) for d in re.finditer(r"= (\w+\[[\d,]*\])\S* dot\(", body)]
            reduces = [(r.start(), r.group(1), r.group(2)) for r in re.finditer(
                r"= (\w+\[[\d,]*\])\S* reduce\([^\n]*dimensions=\{([\d,]*)\}", body)]
            if dots and reduces:
                order = "reduction first" if reduces[0][0] < dots[0][0] else "product first"
                found[(path.rsplit("/", 1)[-1], tuple(d for _, d in dots),
                       tuple(f"{shape} over {{{dims}}}" for _, shape, dims in reduces), order)] += 1
    for (path, dots, reduces, order), count in sorted(found.items()):
        print(f"{count} x {path}: products {', '.join(dots)}; reductions {', '.join(reduces)}; {order}")
    print(f"{len(sys.argv) - 1} dumps, {sum(found.values())} YNNPACK fusions with a product and a reduction, "
          f"{sum(c for k, c in found.items() if k[3] == 'product first')} with the product first")


if __name__ == "__main__":
    main()
