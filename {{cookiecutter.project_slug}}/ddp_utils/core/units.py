"""Byte sizes in words: one unit system for every size the project prints, binary (KiB, MiB,
GiB, TiB: powers of 1024), as torch, nvidia-smi, `free -h` and `df -h` count them. A GPU sold
as "80GB" has 80 GiB of memory; a disk sold as "1 TB" has 0.91 TiB.

Rates are not sizes: the preflight's all-reduce bandwidths are nccl-tests' algbw and busbw,
in GB/s of 1e9 bytes a second, as nccl-tests prints them."""

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def size_text(nbytes):
    """`nbytes` as people read it: the largest unit that keeps the number at 1 or more (TiB at
    most), with two or three significant digits, as rounded (`0 bytes`, `1023 bytes`,
    `1.00 KiB`, `3.25 MiB`, `14.2 GiB`, `120 GiB`, `1024 TiB`). A negative size keeps its sign."""
    value, unit = float(nbytes), 0
    # 1023.5 and more rounds to 1024: the next unit's 1.00, not "1024 KiB"
    while abs(value) >= 1023.5 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        count = round(value)
        return f"{count} byte" if abs(count) == 1 else f"{count} bytes"
    # the decimals by the number as rounded: 9.996 is "10.0", not "10.00"; 99.96 is "100"
    decimals = 2 if abs(value) < 9.995 else 1 if abs(value) < 99.95 else 0
    return f"{value:.{decimals}f} {UNITS[unit]}"
