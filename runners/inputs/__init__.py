"""What goes into the graphs: text (tokenizer), audio (log-mel), the decoder-only prompt, seeded random inputs, and the checks of what a caller asks for."""
