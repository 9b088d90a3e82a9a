"""Developer tools of torch-overlay: the patch series (generate, check, rebase, ghstack export), benchmarks."""
