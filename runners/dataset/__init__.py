"""Generation over dataset files: the pipeline, its file formats, the run record and Ray Data."""
