import time, os, sys
def main():
    t0 = time.time()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.config import KVTransferConfig
    t1 = time.time()
    kw = {}
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        sys.path.insert(0, "/tmp/vtest")
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="ProbeConnector", kv_role="kv_both",
            kv_connector_module_path="probe_connector", kv_connector_extra_config={"k": 1})
    llm = LLM(model="/tmp/tinyllama", load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, block_size=32, seed=0, **kw)
    t2 = time.time()
    sp = SamplingParams(temperature=0, max_tokens=8, detokenize=False,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}} if kw else None)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(range(10, 80)))], sp)
    t3 = time.time()
    for o in outs:
        print("TOKENS", list(o.outputs[0].token_ids), "finish", o.outputs[0].finish_reason, "kv_transfer_params", o.kv_transfer_params)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(range(10, 80)))], sp)
    print("TOKENS2", list(outs[0].outputs[0].token_ids))
    print(f"TIMING import={t1-t0:.1f}s init={t2-t1:.1f}s generate={t3-t2:.2f}s")
if __name__ == "__main__":
    main()
