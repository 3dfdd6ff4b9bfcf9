"""What the source checks (tools/check-waits, tools/check-kernel-loading) read C++ and CUDA text with."""


def strip(text):
    """The text with comments, string and character literals blanked (newlines kept, offsets kept). A
    quote after a digit or a letter is a digit separator (10'000'000), not a character literal."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] == '"' or (text[i] == "'" and not (i and (text[i - 1].isalnum() or text[i - 1] == "_"))):
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def matching(text, i, open_ch, close_ch):
    """The index just past the bracket that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)
