"""Chakra execution traces in and out: reader (decoding v0.0.4, v0.0.1 and JSON), writer
(file naming, framing and atomic writes), convert, feeder (strict replay in dependency
order), validate (the rules consumers rely on) and stats; proto/ holds the schemas."""
