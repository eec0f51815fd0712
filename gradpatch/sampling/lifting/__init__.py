"""Compiling a copy of a function without its in-body no_grad (lift), and recognising code objects and
torch's grad-mode decorator wrapper (bytecode)."""
