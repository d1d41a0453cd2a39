"""
Tests for L{llmgw.crash}: each class from samples of the engines' own
messages. Each sample names where its text comes from; they were written
from those sources' message strings, not captured from a run here.
"""

from __future__ import annotations

import signal

from twisted.trial.unittest import SynchronousTestCase

from llmgw.crash import FETCH_CLASSES, CrashClass, classify, effective_signal

C = CrashClass

# (sample, source, exit code, signal, expected class)
SAMPLES: list[tuple[str, str, int, int, CrashClass]] = [
    # -- out of memory ----------------------------------------------------------
    ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
     "total capacity of 79.15 GiB of which 1.23 GiB is free.",
     "PyTorch c10/cuda/CUDACachingAllocator.cpp (torch >= 2.5 names it torch.OutOfMemoryError)",
     1, 0, C.OOM),
    ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
     "reported at some other API call",
     "PyTorch c10/cuda/CUDAException.h, cudaErrorMemoryAllocation's text", 1, 0, C.OOM),
    ("ValueError: No available memory for the cache blocks. Try increasing "
     "`gpu_memory_utilization` when initializing the engine.",
     "vLLM vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory", 1, 0, C.OOM),
    ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
     "SGLang python/sglang/srt/model_executor/model_runner.py init_memory_pool", 1, 0, C.OOM),
    ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: "
     "cudaMalloc failed: out of memory\nllama_model_load: error loading model: unable to "
     "allocate CUDA0 buffer",
     "llama.cpp ggml/src/ggml-cuda/ggml-cuda.cu and src/llama.cpp", 1, 0, C.OOM),
    ("llama_init_from_model: failed to allocate CUDA0 buffer for kv cache",
     "llama.cpp src/llama-kv-cache.cpp", 1, 0, C.OOM),
    ("Out of memory: Killed process 12345 (python3) total-vm:81234567kB, anon-rss:7654321kB",
     "Linux mm/oom_kill.c, relayed into the output", 0, signal.SIGKILL, C.OOM),
    ("Memory cgroup out of memory: Killed process 4242 (llama-server)",
     "Linux mm/oom_kill.c (cgroup limit), with a shell's exit 137", 137, 0, C.OOM),
    # -- configuration -------------------------------------------------------------
    ("usage: api_server.py [-h] [--host HOST]\napi_server.py: error: unrecognized arguments: "
     "--bogus-flag",
     "CPython Lib/argparse.py (vLLM's FlexibleArgumentParser, SGLang's ServerArgs)",
     2, 0, C.CONFIG),
    ("api_server.py: error: argument --dtype: invalid choice: 'float8' (choose from 'auto', "
     "'half', 'float16', 'bfloat16', 'float', 'float32')",
     "CPython Lib/argparse.py _check_value", 2, 0, C.CONFIG),
    ("error: invalid argument: --bogus",
     "llama.cpp common/arg.cpp common_params_parse_ex", 1, 0, C.CONFIG),
    ("gguf_init_from_file: failed to open GGUF file 'missing.gguf'\nllama_model_load: error "
     "loading model: llama_model_loader: failed to load model from missing.gguf\n"
     "srv    load_model: failed to load model, 'missing.gguf'\n"
     "main: exiting due to model loading error",
     "llama.cpp ggml/src/gguf.cpp, src/llama-model-loader.cpp, tools/server/server.cpp",
     1, 0, C.CONFIG),
    ("OSError: nosuch/model is not a local folder and is not a valid model identifier listed "
     "on 'https://huggingface.co/models'",
     "Hugging Face transformers src/transformers/utils/hub.py cached_file", 1, 0, C.CONFIG),
    ("ValueError: Invalid repository ID or local directory specified: 'nosuch/model'.",
     "vLLM vllm/transformers_utils/config.py get_config", 1, 0, C.CONFIG),
    ("ValueError: Total number of attention heads (32) must be divisible by tensor parallel "
     "size (3).",
     "vLLM vllm/config ModelConfig.verify_with_parallel_config", 1, 0, C.CONFIG),
    ("ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
     "that can be stored in KV cache (8192). Try increasing `gpu_memory_utilization` or "
     "decreasing `max_model_len` when initializing the engine.",
     "vLLM vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory", 1, 0, C.CONFIG),
    ("llmgw: cannot run 'vllm-nosuch': No such file or directory",
     "llmgw's own launcher (llmgw/agent/supervisor.py)", 127, 0, C.CONFIG),
    # -- port in use ------------------------------------------------------------------
    ("OSError: [Errno 98] Address already in use",
     "CPython socket.bind on Linux (vLLM's and SGLang's servers bind early)", 1, 0,
     C.PORT_IN_USE),
    ("ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 8000): "
     "address already in use",
     "uvicorn uvicorn/server.py startup", 1, 0, C.PORT_IN_USE),
    ("main: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080",
     "llama.cpp tools/server/server.cpp", 1, 0, C.PORT_IN_USE),
    # -- engine crash ---------------------------------------------------------------------
    ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call "
     "first):", "CPython Modules/faulthandler.c", 0, signal.SIGSEGV, C.ENGINE_CRASH),
    ("terminate called after throwing an instance of 'c10::Error'\n  what():  CUDA error: an "
     "illegal memory access was encountered",
     "libstdc++ verbose terminate handler; CUDA's cudaErrorIllegalAddress text",
     0, signal.SIGABRT, C.ENGINE_CRASH),
    ("/src/ggml/src/ggml.c:1234: GGML_ASSERT(ggml_nelements(a) == ne0) failed",
     "llama.cpp ggml/src/ggml.c GGML_ASSERT", 134, 0, C.ENGINE_CRASH),
    ("Traceback (most recent call last):\n  File \"/x/engine.py\", line 9, in run\n"
     "KeyError: 'layers.0.weight'", "CPython's traceback printer", 1, 0, C.ENGINE_CRASH),
    # -- killed -------------------------------------------------------------------------------
    ("INFO:     Started server process [123]", "uvicorn startup line", 0, signal.SIGKILL,
     C.KILLED),
    ("", "no output", 143, 0, C.KILLED),
    ("RuntimeError: Engine core initialization failed. See root cause above. Failed core "
     "proc(s): {'EngineCore_0': -9}",
     "vLLM vllm/v1/engine/utils.py wait_for_engine_startup", 1, 0, C.KILLED),
    # -- unknown ---------------------------------------------------------------------------------
    ("loading weights\ndone", "no known message", 3, 0, C.UNKNOWN),
    ("", "a clean exit nobody asked for", 0, 0, C.UNKNOWN),
]


class ClassifyTests(SynchronousTestCase):
    def test_samples(self) -> None:
        """
        Every sample of a real engine message, with its exit, gets its class.
        """
        for text, source, code, sig, expected in SAMPLES:
            self.assertEqual(classify(code, sig, text), expected, f"{source}: {text!r}")

    def test_every_class_sampled(self) -> None:
        """
        The samples cover every class found in a process's output, so none
        goes untested (a fetch's classes come from the model cache, hung
        from the control plane's verdict on a wedged replica).
        """
        self.assertEqual({s[4] for s in SAMPLES}, set(CrashClass) - FETCH_CLASSES - {CrashClass.HUNG})

    def test_asked_stop_is_not_killed(self) -> None:
        """
        A TERM or KILL the agent sent itself (a startup timeout) is no
        evidence of being killed: the class comes from the output alone.
        """
        self.assertEqual(classify(0, signal.SIGTERM, "", asked=True), C.UNKNOWN)
        self.assertEqual(classify(0, signal.SIGKILL, "CUDA out of memory", asked=True), C.OOM)
        self.assertEqual(classify(0, signal.SIGKILL, "", asked=False), C.KILLED)

    def test_oom_before_traceback(self) -> None:
        """
        An out-of-memory error printed as a traceback is OOM, not a crash,
        and a fatal signal with an OOM message is OOM too.
        """
        self.assertEqual(classify(0, signal.SIGABRT, "what():  CUDA out of memory"), C.OOM)

    def test_shell_exit_codes(self) -> None:
        """
        A shell's 128+N exit code counts as signal N; other codes above 128
        do not.
        """
        self.assertEqual(effective_signal(139, 0), signal.SIGSEGV)
        self.assertEqual(effective_signal(137, 0), signal.SIGKILL)
        self.assertEqual(effective_signal(200, 0), 0)
        self.assertEqual(effective_signal(1, signal.SIGBUS), signal.SIGBUS)
        self.assertEqual(classify(139, 0, ""), C.ENGINE_CRASH)

    def test_values_on_the_wire(self) -> None:
        """
        The class values are the short names events and metric labels use.
        """
        self.assertEqual([c.value for c in CrashClass],
                         ["oom", "config", "port_in_use", "engine_crash", "killed", "hung", "disk_full",
                          "checksum", "not_found", "denied", "fetch", "unknown"])

    def test_bounded_search(self) -> None:
        """
        Only the end of a huge output is searched: an old message far back
        does not decide the class.
        """
        text = "CUDA out of memory\n" + "x" * 100_000 + "\nerror: invalid argument: --x"
        self.assertEqual(classify(1, 0, text), C.CONFIG)
