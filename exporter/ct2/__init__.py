"""CTranslate2 checkpoints (faster-whisper's Whisper) read into HF model folders."""
