# Run by wsl2/shared_usage.py through `powershell.exe -NoProfile -NonInteractive -EncodedCommand` from inside WSL2.
# Every line written is one JSON document. First, once: the display adapters' names by LUID, which Windows' GPU
# counters do not carry ({"Adapters": {"luid_0x..._0x...": "NVIDIA GeForce RTX 4090", ...}}), read through the
# display kernel's own calls (D3DKMTEnumAdapters2, then D3DKMTQueryAdapterInfo for the adapter's registry
# strings); where that fails, {"AdapterNamesError": "..."} and sampling goes on. Then one line per sample:
# every adapter's Shared Usage and Dedicated Usage, with Path, InstanceName and CookedValue (bytes).
try {
    Add-Type -TypeDefinition @'
using System;
using System.Collections.Generic;
using System.Runtime.InteropServices;

public static class ServekitAdapters {
    [StructLayout(LayoutKind.Sequential)] struct ENUMADAPTERS2 { public uint NumAdapters; public IntPtr pAdapters; }
    [StructLayout(LayoutKind.Sequential)] struct ADAPTERINFO {
        public uint hAdapter; public uint LuidLowPart; public int LuidHighPart; public uint NumOfSources;
        public int bPrecisePresentRegionsPreferred;
    }
    [StructLayout(LayoutKind.Sequential)] struct QUERYADAPTERINFO {
        public uint hAdapter; public int Type; public IntPtr pPrivateDriverData; public uint PrivateDriverDataSize;
    }
    [StructLayout(LayoutKind.Sequential)] struct CLOSEADAPTER { public uint hAdapter; }
    [DllImport("gdi32.dll")] static extern int D3DKMTEnumAdapters2(ref ENUMADAPTERS2 enumerate);
    [DllImport("gdi32.dll")] static extern int D3DKMTQueryAdapterInfo(ref QUERYADAPTERINFO query);
    [DllImport("gdi32.dll")] static extern int D3DKMTCloseAdapter(ref CLOSEADAPTER close);
    const int KMTQAITYPE_ADAPTERREGISTRYINFO = 8;
    const int REGISTRY_INFO_BYTES = 4 * 260 * 2;  // four WCHAR[MAX_PATH]; AdapterString is the first

    public static Dictionary<string, string> Names() {
        var names = new Dictionary<string, string>();
        int size = Marshal.SizeOf(typeof(ADAPTERINFO));
        var all = new ENUMADAPTERS2 { NumAdapters = 64 };  // in: room for 64; out: how many there are
        all.pAdapters = Marshal.AllocHGlobal(size * (int)all.NumAdapters);
        try {
            if (D3DKMTEnumAdapters2(ref all) != 0) return names;
            for (int i = 0; i < all.NumAdapters; i++) {
                var adapter = (ADAPTERINFO)Marshal.PtrToStructure(new IntPtr(all.pAdapters.ToInt64() + i * size),
                                                                  typeof(ADAPTERINFO));
                IntPtr info = Marshal.AllocHGlobal(REGISTRY_INFO_BYTES);
                try {
                    var query = new QUERYADAPTERINFO { hAdapter = adapter.hAdapter, Type = KMTQAITYPE_ADAPTERREGISTRYINFO,
                                                       pPrivateDriverData = info, PrivateDriverDataSize = REGISTRY_INFO_BYTES };
                    if (D3DKMTQueryAdapterInfo(ref query) == 0)
                        names[String.Format("luid_0x{0:x8}_0x{1:x8}", adapter.LuidHighPart, adapter.LuidLowPart)] =
                            Marshal.PtrToStringUni(info);
                } finally {
                    Marshal.FreeHGlobal(info);
                    var close = new CLOSEADAPTER { hAdapter = adapter.hAdapter };
                    D3DKMTCloseAdapter(ref close);
                }
            }
        } finally {
            Marshal.FreeHGlobal(all.pAdapters);
        }
        return names;
    }
}
'@
    @{ Adapters = [ServekitAdapters]::Names() } | ConvertTo-Json -Compress
} catch {
    @{ AdapterNamesError = $_.Exception.Message } | ConvertTo-Json -Compress
}
Get-Counter -Counter '\GPU Adapter Memory(*)\Shared Usage','\GPU Adapter Memory(*)\Dedicated Usage' `
    -SampleInterval SAMPLE_INTERVAL_S -Continuous | ForEach-Object {
    $_.CounterSamples | Select-Object Path,InstanceName,CookedValue | ConvertTo-Json -Compress
}
