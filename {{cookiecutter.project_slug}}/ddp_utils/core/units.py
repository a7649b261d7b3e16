"""Byte sizes in words: one unit system for every line the project prints (binary: KiB, MiB,
GiB, TiB, as GPU memory and `free -h` count them)."""

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def size_text(nbytes):
    """`nbytes` as people read it: the largest unit that keeps the number at 1 or more, with two
    or three significant digits (`512 bytes`, `3.25 MiB`, `14.2 GiB`, `120 GiB`)."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(nbytes)} bytes"
    return (
        f"{value:.0f} {UNITS[unit]}"
        if abs(value) >= 100
        else f"{value:.1f} {UNITS[unit]}"
        if abs(value) >= 10
        else f"{value:.2f} {UNITS[unit]}"
    )
