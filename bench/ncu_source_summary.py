#!/usr/bin/env python3
"""Summarises an ncu source-page export of one kernel (per-SASS-instruction counters).

Input: the CSV of `ncu -i REPORT --page source --csv --print-source sass` (gzip or plain) for a
report collected with `--section SourceCounters --section WarpStateStats`. Prints the executed
warp-instructions grouped by execution count (instructions run the same number of times form
one code region: once per CTA, once per tile, ...), by opcode, the warp-stall mix of the
samples, and the instructions with the most stall samples.

  bench/ncu_source_summary.py FILE.csv[.gz] [--top N]
"""
import argparse
import collections
import csv
import gzip


def load(path):
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rt') as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if 'Address' in r and 'Source' in r)
    names = rows[header]
    col = {name: i for i, name in enumerate(names)}
    stalls = [n for n in names if n.startswith('stall_') and 'Not Issued' not in n]
    out = []
    for r in rows[header + 1:]:
        if len(r) < len(names):
            continue
        num = lambda name: int(r[col[name]] or 0)
        out.append({'sass': r[col['Source']].strip(),
                    'samples': num('Warp Stall Sampling (All Samples)'),
                    'executed': num('Instructions Executed'),
                    'stalls': {n[len('stall_'):]: num(n) for n in stalls}})
    return out


def opcode(sass):
    words = sass.split()
    if not words:
        return '?'
    word = words[1] if words[0].startswith('@') and len(words) > 1 else words[0]
    return word.split('.')[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('csv')
    parser.add_argument('--top', type=int, default=15)
    args = parser.parse_args()
    inst = load(args.csv)
    executed = sum(i['executed'] for i in inst)
    samples = max(1, sum(i['samples'] for i in inst))
    print(f'{len(inst)} SASS instructions, {executed} warp-instructions executed, '
          f'{samples} stall samples')

    regions = collections.defaultdict(list)
    for n, i in enumerate(inst):
        if i['executed']:
            regions[i['executed']].append(n)
    print('regions (execution count x instructions: share of executed, samples):')
    for count, idx in sorted(regions.items(), key=lambda kv: -kv[0] * len(kv[1]))[:10]:
        share = 100 * count * len(idx) / executed
        region_samples = sum(inst[n]['samples'] for n in idx)
        print(f'  {count:8d} x {len(idx):5d}: {share:5.1f} %, {region_samples:5d} samples '
              f'(instructions {idx[0]}..{idx[-1]})')

    by_op = collections.Counter()
    for i in inst:
        by_op[opcode(i['sass'])] += i['executed']
    print('opcodes (share of executed):',
          ', '.join(f'{o} {100 * e / executed:.1f} %' for o, e in by_op.most_common(16)))

    mix = collections.Counter()
    for i in inst:
        mix.update(i['stalls'])
    print('stall mix:', ', '.join(f'{s} {100 * v / samples:.1f} %' for s, v in mix.most_common(10)))

    print('instructions with the most samples:')
    ranked = sorted(range(len(inst)), key=lambda n: -inst[n]['samples'])[:args.top]
    for n in ranked:
        i = inst[n]
        why = ', '.join(f'{s} {v}' for s, v in sorted(i['stalls'].items(),
                                                    key=lambda kv: -kv[1])[:3] if v)
        print(f'  #{n:5d} {i["samples"]:5d} ({100 * i["samples"] / samples:4.1f} %) '
              f'x{i["executed"]:8d}  {i["sass"][:58]:58s} {why}')


if __name__ == '__main__':
    main()
