"""Tool-call parsers (``--tool-call-parser``: hermes, llama3_json, mistral, pythonic) and
reasoning parsers (``--reasoning-parser``: deepseek-r1, qwen3, qwen3-thinking) for the chat
route, with the names SGLang and vLLM give them. The parsers import nothing heavy (no torch)."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.4"


@hookimpl
def register_tool_parsers(register):
    from engine_parsers.hermes import HermesParser
    from engine_parsers.llama3_json import Llama3JsonParser
    from engine_parsers.mistral import MistralParser
    from engine_parsers.pythonic import PythonicParser

    register("hermes", HermesParser, aliases=("qwen25", "qwen"),
             description="<tool_call>{json}</tool_call> (Hermes 2 Pro, Qwen2.5, Qwen3)")
    register("llama3_json", Llama3JsonParser, aliases=("llama3",),
             description="JSON objects separated by ';' (Llama 3.1/3.2)")
    register("mistral", MistralParser,
             description="[TOOL_CALLS] [{json}, ...] or [TOOL_CALLS]name[ARGS]{json}")
    register("pythonic", PythonicParser, aliases=("llama4_pythonic",),
             description="[f(a=1), g(b='x')] (Llama 3.2, Llama 4)")


@hookimpl
def register_reasoning_parsers(register):
    from engine_parsers.think import DeepSeekR1Parser, Qwen3Parser, Qwen3ThinkingParser

    register("deepseek-r1", DeepSeekR1Parser, aliases=("deepseek_r1",),
             description="<think>...</think>, opened by the chat template (DeepSeek-R1)")
    register("qwen3", Qwen3Parser,
             description="<think>...</think> when the output opens it (Qwen3)")
    register("qwen3-thinking", Qwen3ThinkingParser,
             description="<think>...</think>, opened by the chat template (Qwen3 2507 thinking)")
