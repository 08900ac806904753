"""CPU time per decode token at 1 thread: olv (int8 activations / exact) vs llama.cpp on one GGUF.

Less sensitive to other processes than wall-clock tok/s on a shared machine (a waiting thread
costs no CPU time). Usage (inside ``flock /tmp/olv_bench.lock``):

    python bench/gguf_cpu_time.py FILE.gguf CONVERTED/model.onnx

(the .onnx from ``olv convert FILE.gguf``; bench/decode.py --gguf writes it under
``~/.cache/olv_bench/gguf_olv/<stem>/``). Prints the median CPU ms per token of 24 decode tokens
after a 32-token prompt, two alternating rounds per backend, and the ratios.
"""
import sys, time, numpy as np
import olv_runtime, llama_cpp
gguf, onnx = sys.argv[1], sys.argv[2]
T = 24
def olv(quant):
    sess = olv_runtime.InferenceSession(olv_runtime.load(onnx), olv_runtime.SessionOptions(num_threads=1, quantize_activations=quant))
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    st.run({"input_ids": np.arange(1, 33, dtype=np.int64)[None]})
    for i in range(4): st.run({"input_ids": np.array([[40 + i]], np.int64)})
    ts = []
    for i in range(T):
        t = time.process_time(); st.run({"input_ids": np.array([[50 + i]], np.int64)}); ts.append(time.process_time() - t)
    return np.median(ts)
def llama():
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=128, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval(list(range(1, 33)))
    for i in range(4): llm.eval([40 + i])
    ts = []
    for i in range(T):
        t = time.process_time(); llm.eval([50 + i]); ts.append(time.process_time() - t)
    return np.median(ts)
res = {}
for rep in range(2):
    for name, f in (("llama", llama), ("olv_q", lambda: olv(True)), ("olv", lambda: olv(False))):
        res.setdefault(name, []).append(f())
for k, v in res.items():
    print(f"{k}: CPU ms/token {[round(x*1e3, 2) for x in v]}")
l = min(res["llama"]); print("ratio (llama cpu / olv cpu): int8 %.2f exact %.2f" % (l / min(res["olv_q"]), l / min(res["olv"])))
