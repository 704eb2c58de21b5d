"""Stand-in: the real module redirects ``torch.cuda`` to ``torch.npu``; under emulation both are
the CPU already, so importing it changes nothing."""
